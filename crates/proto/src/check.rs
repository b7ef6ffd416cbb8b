//! Validation of what arrives, before a receiver uses any of it.

use crate::{BoundarySchema, ErrorKind, Forward, OpenSession, Pooling, Ring, SeamDtype, MAX_DRAFT, MAX_STOP_TOKENS, PROTOCOL_VERSION};

/// A session's handle: 128 random bits.
pub type SessionId = [u8; 16];

#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ProtoError {
    #[error("session id must be 16 bytes, got {0}")]
    BadSessionId(usize),
    #[error("boundary schema mismatch: {0}")]
    SchemaMismatch(String),
    #[error("bad input: {0}")]
    BadInput(String),
    #[error("bad frame: {0}")]
    BadFrame(String),
    /// Hidden rows holding a NaN or an infinity: a broken or hostile previous stage.
    #[error("bad input: non-finite activations at row {row} of the frame (position {position}, column {column}: {value})")]
    NonFinite { row: usize, position: u64, column: usize, value: f32 },
}

impl ProtoError {
    pub fn kind(&self) -> ErrorKind {
        match self {
            ProtoError::BadSessionId(_) | ProtoError::BadFrame(_) => ErrorKind::BadFrame,
            ProtoError::SchemaMismatch(_) => ErrorKind::SchemaMismatch,
            ProtoError::BadInput(_) | ProtoError::NonFinite { .. } => ErrorKind::BadInput,
        }
    }
}

pub fn session_id(bytes: &[u8]) -> Result<SessionId, ProtoError> {
    bytes.try_into().map_err(|_| ProtoError::BadSessionId(bytes.len()))
}

/// Checks an OpenSession against what this stage serves (`ours`, with the layers it holds and
/// the seam dtypes it accepts) and returns the session id and the dtype the session will use.
/// The session may run any non-empty part of the held layers.
pub fn check_open(open: &OpenSession, ours: &BoundarySchema, dtypes: &[SeamDtype]) -> Result<(SessionId, SeamDtype), ProtoError> {
    let id = session_id(&open.session_id)?;
    let s = open.schema.as_ref().ok_or_else(|| ProtoError::BadFrame("OpenSession without a schema".into()))?;
    let mismatch = |what: &str, theirs: String, mine: String| {
        Err(ProtoError::SchemaMismatch(format!("{what}: the session expects {theirs}, this stage has {mine}")))
    };
    if s.protocol_version != PROTOCOL_VERSION {
        return mismatch("protocol version", s.protocol_version.to_string(), PROTOCOL_VERSION.to_string());
    }
    if s.model_id != ours.model_id {
        return mismatch("model identity", s.model_id.clone(), ours.model_id.clone());
    }
    if s.engine != ours.engine {
        return mismatch("engine", s.engine.clone(), ours.engine.clone());
    }
    if s.layer_start >= s.layer_end || s.layer_start < ours.layer_start || s.layer_end > ours.layer_end {
        return mismatch("layer range", format!("{}..{}", s.layer_start, s.layer_end), format!("{}..{}", ours.layer_start, ours.layer_end));
    }
    if s.hidden != ours.hidden {
        return mismatch("hidden size", s.hidden.to_string(), ours.hidden.to_string());
    }
    let dtype =
        SeamDtype::try_from(s.seam_dtype).map_err(|_| ProtoError::SchemaMismatch(format!("unknown seam dtype {}", s.seam_dtype)))?;
    if !dtypes.contains(&dtype) {
        return mismatch("seam dtype", dtype.name().into(), format!("{dtypes:?}"));
    }
    if open.n_stages == 0 || open.stage_index >= open.n_stages {
        return Err(ProtoError::BadFrame(format!("stage {} of {}", open.stage_index, open.n_stages)));
    }
    if let Some(e) = &open.embed {
        Pooling::try_from(e.pooling).map_err(|_| ProtoError::BadInput(format!("unknown pooling {}", e.pooling)))?;
    }
    if let Some(r) = &open.ring {
        check_ring(open, r)?;
    }
    Ok((id, dtype))
}

/// A ring's part for this stage: the first stage drafts (from the prompt), the last sends its
/// tokens to the first (by address, unless it is the first too); no other stage takes part.
fn check_ring(open: &OpenSession, r: &Ring) -> Result<(), ProtoError> {
    let bad = |why: &str| Err(ProtoError::BadFrame(format!("a ring session's open: {why}")));
    let (first, last) = (open.stage_index == 0, open.next.is_empty());
    if !first && !last {
        return bad("only the first and last stages take part in a ring");
    }
    if open.embed.is_some() {
        return bad("an embedding samples nothing to send round");
    }
    if !last && (!r.to.is_empty() || !r.stop.is_empty()) {
        return bad("only the last stage sends tokens round");
    }
    if last && r.to.is_empty() != first {
        return bad("the last stage sends to the first stage's address, unless it is the first too");
    }
    if !first && (r.speculate != 0 || !r.prompt.is_empty()) {
        return bad("only the first stage drafts");
    }
    if r.stop.len() > MAX_STOP_TOKENS || r.speculate as usize > MAX_DRAFT || r.prompt.len() as u64 > open.max_positions {
        return Err(ProtoError::BadInput(format!(
            "a ring of {} stop tokens (at most {MAX_STOP_TOKENS}), {} drafts (at most {MAX_DRAFT}) and a prompt of {} tokens in {} positions",
            r.stop.len(),
            r.speculate,
            r.prompt.len(),
            open.max_positions
        )));
    }
    Ok(())
}

/// Checks a Forward's rows against the session it names: token ids for a first stage, hidden
/// rows of `hidden` values in the session's dtype otherwise, every one finite; at most
/// `max_rows` rows. Returns the number of rows.
pub fn check_forward(f: &Forward, first_stage: bool, hidden: usize, dtype: SeamDtype, max_rows: usize) -> Result<usize, ProtoError> {
    let rows = if first_stage {
        if !f.hidden.is_empty() {
            return Err(ProtoError::BadInput("hidden rows sent to the first stage".into()));
        }
        f.tokens.len()
    } else {
        if !f.tokens.is_empty() {
            return Err(ProtoError::BadInput("token ids sent past the first stage".into()));
        }
        if f.dtype != dtype as i32 {
            return Err(ProtoError::BadInput(format!("rows in dtype {} on a {} seam", f.dtype, dtype.name())));
        }
        let row_bytes = hidden * dtype.size();
        if f.n_rows == 0 || f.hidden.len() != f.n_rows as usize * row_bytes {
            return Err(ProtoError::BadInput(format!(
                "{} bytes are not {} rows of hidden size {} in {}",
                f.hidden.len(),
                f.n_rows,
                hidden,
                dtype.name()
            )));
        }
        f.n_rows as usize
    };
    if rows == 0 || rows > max_rows {
        return Err(ProtoError::BadInput(format!("{rows} rows (at most {max_rows} per frame)")));
    }
    check_draft(f, first_stage, rows)?;
    if !first_stage {
        check_finite(&f.hidden, hidden, dtype, f.position)?;
    }
    Ok(rows)
}

/// A speculative step's drafts: at most `MAX_DRAFT`, in a frame that samples without a mask,
/// one row each after the frame's first; on the first stage, the tokens of those rows.
fn check_draft(f: &Forward, first_stage: bool, rows: usize) -> Result<(), ProtoError> {
    if f.draft.is_empty() {
        return Ok(());
    }
    let bad = |why: String| Err(ProtoError::BadInput(why));
    if f.draft.len() > MAX_DRAFT {
        return bad(format!("{} draft tokens (at most {MAX_DRAFT})", f.draft.len()));
    }
    if !f.sample || !f.allowed.is_empty() {
        return bad("draft tokens in a frame that does not sample, or samples under a mask".into());
    }
    if rows != f.draft.len() + 1 {
        return bad(format!("{rows} rows for {} draft tokens (a speculative step is one row and its drafts)", f.draft.len()));
    }
    if first_stage && f.tokens[1..] != f.draft[..] {
        return bad("the draft tokens are not the frame's tokens after its first".into());
    }
    Ok(())
}

/// Checks that every value of `bytes` (rows of `hidden` values in `dtype`, the first at
/// `position`) is finite, on the encoded bits: no decoding, one pass the compiler vectorizes.
/// The error names the first bad row, column and value.
pub fn check_finite(bytes: &[u8], hidden: usize, dtype: SeamDtype, position: u64) -> Result<(), ProtoError> {
    // A value is NaN or ±Inf exactly when its exponent bits are all ones.
    fn any_bad<const N: usize>(row: &[u8], exp: u32) -> bool {
        row.chunks_exact(N).fold(false, |acc, b| {
            let bits = if N == 4 { u32::from_le_bytes([b[0], b[1], b[2], b[3]]) } else { u16::from_le_bytes([b[0], b[1]]) as u32 };
            acc | (bits & exp == exp)
        })
    }
    let exp = match dtype {
        SeamDtype::F32 => 0x7f80_0000,
        SeamDtype::F16 => 0x7c00,
        SeamDtype::Bf16 => 0x7f80,
    };
    let row_bytes = (hidden * dtype.size()).max(1);
    for (r, row) in bytes.chunks(row_bytes).enumerate() {
        let bad = if dtype.size() == 4 { any_bad::<4>(row, exp) } else { any_bad::<2>(row, exp) };
        if bad {
            let values = crate::decode_rows(row, dtype);
            let column = values.iter().position(|v| !v.is_finite()).unwrap_or(0);
            return Err(ProtoError::NonFinite { row: r, position: position + r as u64, column, value: values[column] });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schema() -> BoundarySchema {
        BoundarySchema {
            protocol_version: PROTOCOL_VERSION,
            model_id: "m".into(),
            layer_start: 5,
            layer_end: 15,
            hidden: 8,
            seam_dtype: 0,
            engine: "e".into(),
        }
    }

    fn open(s: BoundarySchema) -> OpenSession {
        OpenSession { session_id: vec![7; 16], schema: Some(s), stage_index: 0, n_stages: 2, ..Default::default() }
    }

    #[test]
    fn open_checks_every_schema_field() {
        let ours = schema();
        assert!(check_open(&open(schema()), &ours, &[SeamDtype::F32]).is_ok());
        let bad = [
            BoundarySchema { protocol_version: 99, ..schema() },
            BoundarySchema { model_id: "other".into(), ..schema() },
            BoundarySchema { engine: "other".into(), ..schema() },
            BoundarySchema { layer_end: 16, ..schema() },
            BoundarySchema { layer_start: 4, ..schema() },
            BoundarySchema { layer_start: 0, layer_end: 10, ..schema() },
            BoundarySchema { layer_start: 10, layer_end: 10, ..schema() },
            BoundarySchema { layer_start: 12, layer_end: 8, ..schema() },
            BoundarySchema { hidden: 9, ..schema() },
            BoundarySchema { seam_dtype: 1, ..schema() },
            BoundarySchema { seam_dtype: 77, ..schema() },
        ];
        for s in bad {
            assert!(matches!(check_open(&open(s), &ours, &[SeamDtype::F32]), Err(ProtoError::SchemaMismatch(_))));
        }
        // Any non-empty part of the held layers.
        for (start, end) in [(5, 6), (5, 10), (10, 15), (14, 15), (7, 12)] {
            let part = BoundarySchema { layer_start: start, layer_end: end, ..schema() };
            assert!(check_open(&open(part), &ours, &[SeamDtype::F32]).is_ok(), "{start}..{end}");
        }
        let mut short_id = open(schema());
        short_id.session_id.pop();
        assert_eq!(check_open(&short_id, &ours, &[SeamDtype::F32]), Err(ProtoError::BadSessionId(15)));
    }

    #[test]
    fn a_ring_names_only_the_first_and_last_stages_their_parts() {
        let ours = schema();
        let at = |stage_index, n_stages, next: &str, ring: Ring| OpenSession {
            stage_index,
            n_stages,
            next: next.into(),
            max_positions: 32,
            ring: Some(ring),
            ..open(schema())
        };
        let drafts = Ring { speculate: 8, prompt: vec![1, 2, 3], ..Default::default() };
        let sends = Ring { to: "a:1".into(), stop: vec![2], ..Default::default() };
        let both = Ring { stop: vec![2], ..drafts.clone() };
        let ok = [at(0, 3, "b:1", drafts.clone()), at(2, 3, "", sends.clone()), at(0, 1, "", both.clone())];
        for o in ok {
            assert!(check_open(&o, &ours, &[SeamDtype::F32]).is_ok(), "{:?}", o.ring);
        }
        let refused = [
            ("a middle stage", at(1, 3, "c:1", drafts.clone())),
            ("the first stage sending", at(0, 3, "b:1", sends.clone())),
            ("the last stage drafting", at(2, 3, "", Ring { speculate: 8, ..sends.clone() })),
            ("a last stage with nowhere to send", at(2, 3, "", Ring { to: String::new(), ..sends.clone() })),
            ("a lone stage sending elsewhere", at(0, 1, "", Ring { to: "a:1".into(), ..both.clone() })),
            ("too many stop tokens", at(2, 3, "", Ring { stop: vec![1; MAX_STOP_TOKENS + 1], ..sends.clone() })),
            ("too many drafts", at(0, 3, "b:1", Ring { speculate: MAX_DRAFT as u32 + 1, ..drafts.clone() })),
            ("a prompt past the positions", at(0, 3, "b:1", Ring { prompt: vec![1; 33], ..drafts.clone() })),
            ("an embedding", OpenSession { embed: Some(crate::Embed::default()), ..at(0, 1, "", both.clone()) }),
        ];
        for (what, o) in refused {
            assert!(check_open(&o, &ours, &[SeamDtype::F32]).is_err(), "{what}");
        }
    }

    #[test]
    fn forward_checks_rows_dtype_and_size() {
        let rows = |n: u32, bytes: usize, dtype: i32| Forward { n_rows: n, hidden: vec![0; bytes], dtype, ..Default::default() };
        assert_eq!(check_forward(&rows(2, 64, 0), false, 8, SeamDtype::F32, 16), Ok(2));
        assert!(check_forward(&rows(2, 63, 0), false, 8, SeamDtype::F32, 16).is_err());
        assert!(check_forward(&rows(2, 32, 1), false, 8, SeamDtype::F32, 16).is_err());
        assert!(check_forward(&rows(0, 0, 0), false, 8, SeamDtype::F32, 16).is_err());
        assert!(check_forward(&rows(32, 1024, 0), false, 8, SeamDtype::F32, 16).is_err());
        let toks = Forward { tokens: vec![1, 2, 3], ..Default::default() };
        assert_eq!(check_forward(&toks, true, 8, SeamDtype::F32, 16), Ok(3));
        assert!(check_forward(&toks, false, 8, SeamDtype::F32, 16).is_err());
        assert!(check_forward(&rows(2, 64, 0), true, 8, SeamDtype::F32, 16).is_err());
    }

    #[test]
    fn a_speculative_step_is_one_row_and_its_drafts() {
        let step = |tokens: Vec<u32>, draft: Vec<u32>| Forward { tokens, draft, sample: true, ..Default::default() };
        assert_eq!(check_forward(&step(vec![4, 7, 9], vec![7, 9]), true, 8, SeamDtype::F32, 64), Ok(3));
        let refused = [
            ("drafts that are not the tokens", step(vec![4, 7, 9], vec![7, 8])),
            ("more rows than one and the drafts", step(vec![4, 7, 9], vec![9])),
            ("past MAX_DRAFT", step(vec![1; MAX_DRAFT + 2], vec![1; MAX_DRAFT + 1])),
            ("without sampling", Forward { sample: false, ..step(vec![4, 7], vec![7]) }),
            ("under a mask", Forward { allowed: vec![0xff], ..step(vec![4, 7], vec![7]) }),
        ];
        for (what, f) in refused {
            assert!(matches!(check_forward(&f, true, 8, SeamDtype::F32, 64), Err(ProtoError::BadInput(_))), "{what}");
        }
        // Past the first stage the rows are hidden: their count must still fit the drafts.
        let hidden =
            |n: u32, draft: Vec<u32>| Forward { n_rows: n, hidden: vec![0; 32 * n as usize], draft, sample: true, ..Default::default() };
        assert_eq!(check_forward(&hidden(3, vec![1, 2]), false, 8, SeamDtype::F32, 16), Ok(3));
        assert!(check_forward(&hidden(2, vec![1, 2]), false, 8, SeamDtype::F32, 16).is_err());
    }

    #[test]
    fn forward_refuses_non_finite_rows_in_every_dtype() {
        for d in [SeamDtype::F32, SeamDtype::F16, SeamDtype::Bf16] {
            let ok = [0.5f32, -1.0, 0.0, -0.0, 1e-30, 3.0e4, -7.0, 1.0];
            let f =
                |v: &[f32]| Forward { n_rows: 2, hidden: crate::encode_rows(v, d), dtype: d as i32, position: 10, ..Default::default() };
            let rows = [ok, ok].concat();
            assert_eq!(check_forward(&f(&rows), false, 8, d, 16), Ok(2), "{d:?}");
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY, -f32::NAN] {
                let mut rows = rows.clone();
                rows[8 + 5] = bad;
                let e = check_forward(&f(&rows), false, 8, d, 16).unwrap_err();
                assert_eq!(e.kind(), ErrorKind::BadInput, "{d:?} {bad}");
                assert!(matches!(e, ProtoError::NonFinite { row: 1, position: 11, column: 5, .. }), "{d:?} {bad}: {e:?}");
                assert!(e.to_string().contains("non-finite activations at row 1"), "{e}");
            }
        }
        // f32 values past f16's range are finite in f32.
        let big = Forward { n_rows: 1, hidden: crate::encode_rows(&[1e30; 8], SeamDtype::F32), dtype: 0, ..Default::default() };
        assert_eq!(check_forward(&big, false, 8, SeamDtype::F32, 16), Ok(1));
    }

    #[test]
    fn seam_dtypes_round_trip() {
        let v = [0.0f32, 1.5, -2.25, 1e-3, 65504.0];
        for d in [SeamDtype::F32, SeamDtype::F16, SeamDtype::Bf16] {
            let back = crate::decode_rows(&crate::encode_rows(&v, d), d);
            for (a, b) in v.iter().zip(&back) {
                assert!((a - b).abs() <= a.abs() * 0.01, "{d:?}: {a} vs {b}");
            }
        }
        assert_eq!(crate::decode_rows(&crate::encode_rows(&v, SeamDtype::F32), SeamDtype::F32), v);
    }
}
