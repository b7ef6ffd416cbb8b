//! A route's engine: the engine id where every stage computes with one engine, or, where a route
//! mixes engines (CPU layers, then GPU layers), each engine with the layers it computes:
//! `gguf-cpu-fast@0..14+gguf-gpu.1a2b3c4d-exact@14..30`. Tickets, usage records and a recovery's
//! route request carry it, so a replay computes every layer on the engine that computed it
//! first, and so gives the same bits.

use crate::ProtoError;

/// Most spans a route engine may name (a route has at most as many stages as layers; no real one
/// has this many).
pub const MAX_ENGINE_SPANS: usize = 64;
/// Longest engine id a worker may register.
pub const MAX_ENGINE_ID: usize = 64;
/// Longest route engine: every span's engine id and its layers.
pub const MAX_ROUTE_ENGINE: usize = MAX_ENGINE_SPANS * (MAX_ENGINE_ID + 24);

/// One engine and the layers `[start, end)` it computes in a route.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EngineSpan {
    pub engine: String,
    pub start: u32,
    pub end: u32,
}

/// Whether `s` may be a worker's engine id: not empty, not too long, and without the characters
/// that join a mixed route's spans.
pub fn is_engine_id(s: &str) -> bool {
    !s.is_empty() && s.len() <= MAX_ENGINE_ID && !s.contains(['@', '+'])
}

/// The route engine of stages given in layer order as (engine, first layer, end layer): adjacent
/// stages of one engine make one span, and a route of one span is written as its engine id.
pub fn route_engine<'a>(stages: impl IntoIterator<Item = (&'a str, u32, u32)>) -> String {
    let mut spans: Vec<EngineSpan> = Vec::new();
    for (engine, start, end) in stages {
        match spans.last_mut() {
            Some(last) if last.engine == engine && last.end == start => last.end = end,
            _ => spans.push(EngineSpan { engine: engine.into(), start, end }),
        }
    }
    match spans.as_slice() {
        [one] => one.engine.clone(),
        _ => spans.iter().map(|s| format!("{}@{}..{}", s.engine, s.start, s.end)).collect::<Vec<_>>().join("+"),
    }
}

/// The spans of a mixed route's engine, in layer order, contiguous from layer 0; `None` for an
/// engine id (or empty: any engine). A malformed one is an error.
pub fn parse_route_engine(s: &str) -> Result<Option<Vec<EngineSpan>>, ProtoError> {
    if !s.contains('@') {
        return Ok(None);
    }
    let bad = |why: &str| Err(ProtoError::BadInput(format!("route engine {:?}: {why}", truncated(s))));
    let mut spans = Vec::new();
    for part in s.split('+') {
        if spans.len() == MAX_ENGINE_SPANS {
            return bad(&format!("more than {MAX_ENGINE_SPANS} spans"));
        }
        let Some((engine, range)) = part.split_once('@') else { return bad("a span without @FIRST..END") };
        let Some((a, b)) = range.split_once("..") else { return bad("a span's layers are not FIRST..END") };
        let (Ok(start), Ok(end)) = (a.parse::<u32>(), b.parse::<u32>()) else { return bad("a span's layers are not numbers") };
        let at = spans.last().map_or(0, |l: &EngineSpan| l.end);
        if !is_engine_id(engine) || start != at || end <= start {
            return bad("spans must name an engine each and run on from layer 0 without gaps");
        }
        spans.push(EngineSpan { engine: engine.into(), start, end });
    }
    Ok(Some(spans))
}

fn truncated(s: &str) -> &str {
    s.char_indices().nth(200).map_or(s, |(i, _)| &s[..i])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_route_of_one_engine_is_named_by_it_and_a_mixed_one_by_its_spans() {
        let one = route_engine([("gguf-cpu-fast", 0, 10), ("gguf-cpu-fast", 10, 30)]);
        assert_eq!(one, "gguf-cpu-fast");
        assert_eq!(parse_route_engine(&one).unwrap(), None);
        let mixed = route_engine([("cpu", 0, 10), ("cpu", 10, 14), ("gpu.1a", 14, 30)]);
        assert_eq!(mixed, "cpu@0..14+gpu.1a@14..30");
        let spans = parse_route_engine(&mixed).unwrap().unwrap();
        assert_eq!(
            spans,
            [EngineSpan { engine: "cpu".into(), start: 0, end: 14 }, EngineSpan { engine: "gpu.1a".into(), start: 14, end: 30 }]
        );
        assert_eq!(route_engine(spans.iter().map(|s| (s.engine.as_str(), s.start, s.end))), mixed);
    }

    #[test]
    fn a_malformed_route_engine_is_refused() {
        let long: Vec<String> = (0..=MAX_ENGINE_SPANS).map(|i| format!("e@{i}..{}", i + 1)).collect();
        let long = long.join("+");
        for bad in ["e@1..2", "e@0..1+f@2..3", "e@0..0", "@0..1", "e@0-1", "e@0..x", "e@0..1+f", "e@0..1+", &long] {
            assert!(matches!(parse_route_engine(bad), Err(ProtoError::BadInput(_))), "{bad:?}");
        }
        assert!(parse_route_engine(&long[..long.rfind('+').unwrap()]).is_ok(), "{MAX_ENGINE_SPANS} spans are fine");
        assert!(is_engine_id("gguf-gpu.1a2b3c4d-exact") && !is_engine_id("a+b") && !is_engine_id("a@b") && !is_engine_id(""));
    }
}
