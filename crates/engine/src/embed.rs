//! Embeddings: a sequence's final-normed hidden states (what the head would read) pooled into
//! one vector and L2-normalised, as OpenAI and llama-server return them. The pooling sums in
//! position order, one position at a time, so the vector's bits depend only on the rows, never on
//! how the prompt was chunked or what it was batched with.

use crate::EngineError;

/// How a sequence's rows become one vector: llama.cpp's `{arch}.pooling_type` (1 mean, 2 cls,
/// 3 last). A file without the key (or with 0, none) is pooled by the mean; rank (4) is a
/// classifier's head, which dgr does not compute.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Pooling {
    Mean,
    /// The first position's row.
    Cls,
    /// The last position's row.
    Last,
    Rank,
}

impl Pooling {
    /// llama.cpp's number for the pooling; unknown numbers are refused.
    pub fn from_llama(n: u64) -> Result<Pooling, EngineError> {
        match n {
            0 | 1 => Ok(Pooling::Mean),
            2 => Ok(Pooling::Cls),
            3 => Ok(Pooling::Last),
            4 => Ok(Pooling::Rank),
            _ => Err(EngineError::BadConfig(format!("pooling type {n} (known: 0 none, 1 mean, 2 cls, 3 last, 4 rank)"))),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Pooling::Mean => "mean",
            Pooling::Cls => "cls",
            Pooling::Last => "last",
            Pooling::Rank => "rank",
        }
    }
}

/// A sequence's embedding as its rows arrive, in position order, chunk after chunk.
#[derive(Clone, Debug)]
pub struct Pooler {
    pooling: Pooling,
    hidden: usize,
    /// Mean: the running sum; cls and last: the row kept.
    acc: Vec<f32>,
    rows: usize,
}

impl Pooler {
    /// A pooler for rows of `hidden` floats; rank is refused (`Unsupported`).
    pub fn new(pooling: Pooling, hidden: usize) -> Result<Pooler, EngineError> {
        if pooling == Pooling::Rank {
            return Err(EngineError::Unsupported("embeddings of a rank-pooled (classifier) model".into()));
        }
        Ok(Pooler { pooling, hidden, acc: vec![0f32; hidden], rows: 0 })
    }

    /// Adds the next rows (final-normed, `hidden` floats each, in position order).
    pub fn push(&mut self, rows: &[f32]) {
        for row in rows.chunks_exact(self.hidden) {
            match self.pooling {
                Pooling::Mean => self.acc.iter_mut().zip(row).for_each(|(a, x)| *a += x),
                Pooling::Cls if self.rows == 0 => self.acc.copy_from_slice(row),
                Pooling::Last => self.acc.copy_from_slice(row),
                Pooling::Cls | Pooling::Rank => {}
            }
            self.rows += 1;
        }
    }

    /// Rows pooled so far.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The pooled vector, L2-normalised (a zero vector stays zero).
    pub fn finish(mut self) -> Vec<f32> {
        if self.pooling == Pooling::Mean && self.rows > 0 {
            let n = self.rows as f32;
            self.acc.iter_mut().for_each(|a| *a /= n);
        }
        let norm = self.acc.iter().map(|&a| a as f64 * a as f64).sum::<f64>().sqrt();
        if norm > 0.0 {
            self.acc.iter_mut().for_each(|a| *a = (*a as f64 / norm) as f32);
        }
        self.acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn poolings_read_as_llama_cpp_numbers_them() {
        let read: Vec<Pooling> = (0..5).map(|n| Pooling::from_llama(n).unwrap()).collect();
        assert_eq!(read, [Pooling::Mean, Pooling::Mean, Pooling::Cls, Pooling::Last, Pooling::Rank]);
        assert!(matches!(Pooling::from_llama(5), Err(EngineError::BadConfig(_))));
        assert!(matches!(Pooler::new(Pooling::Rank, 4), Err(EngineError::Unsupported(_))));
    }

    #[test]
    fn pooled_bits_do_not_depend_on_the_chunks() {
        let rows: Vec<f32> = (0..5 * 3).map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.1).collect();
        for pooling in [Pooling::Mean, Pooling::Cls, Pooling::Last] {
            let mut whole = Pooler::new(pooling, 3).unwrap();
            whole.push(&rows);
            let mut chunked = Pooler::new(pooling, 3).unwrap();
            for chunk in rows.chunks(6) {
                chunked.push(chunk);
            }
            let (a, b) = (whole.finish(), chunked.finish());
            assert_eq!(a.iter().map(|x| x.to_bits()).collect::<Vec<_>>(), b.iter().map(|x| x.to_bits()).collect::<Vec<_>>());
            let norm: f32 = a.iter().map(|x| x * x).sum();
            assert!((norm - 1.0).abs() < 1e-6, "{pooling:?}: |v|² = {norm}");
        }
        let pooled = |p| {
            let mut x = Pooler::new(p, 3).unwrap();
            x.push(&rows);
            x.finish()
        };
        let last = pooled(Pooling::Last);
        let n = (rows[12..].iter().map(|x| x * x).sum::<f32>()).sqrt();
        assert!(last.iter().zip(&rows[12..]).all(|(a, b)| (a - b / n).abs() < 1e-6));
        assert_ne!(pooled(Pooling::Mean), last);
    }
}
