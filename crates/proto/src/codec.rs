use tokio_util::codec::LengthDelimitedCodec;

/// The default cap on one frame: a prefill of 8192 rows of 1024 f32 values fits, with room.
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// The framing: a 4-byte big-endian length, then that many bytes of one protobuf `Frame`.
/// A longer frame is refused by the decoder before any of it is buffered.
pub fn codec(max_frame: usize) -> LengthDelimitedCodec {
    LengthDelimitedCodec::builder().length_field_length(4).big_endian().max_frame_length(max_frame).new_codec()
}
