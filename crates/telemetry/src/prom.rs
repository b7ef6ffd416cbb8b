//! Prometheus text exposition (format 0.0.4), the one renderer every service's `/metrics` goes
//! through. It writes exactly what scrapers, the tests and the dashboard read today: a counter's
//! HELP and TYPE name the sample itself (`x_total`), bucket bounds are written as Rust prints
//! them (`le="1"`), and there is no OpenMetrics `# EOF` — which is why this is not the
//! `prometheus-client` crate, whose OpenMetrics output changes all three.

use std::fmt::{Display, Write};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Counter,
    Gauge,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
        }
    }
}

/// A page of metric families being written.
#[derive(Default)]
pub struct Text {
    out: String,
}

impl Text {
    pub fn new() -> Text {
        Text::default()
    }

    /// A family of one sample without labels.
    pub fn metric(&mut self, name: &str, help: &str, kind: Kind, value: impl Display) {
        self.family(name, help, kind).sample(&[], value);
    }

    /// A family's HELP and TYPE; its samples follow through the handle. A family without
    /// samples still says it exists.
    pub fn family<'t>(&'t mut self, name: &'t str, help: &str, kind: Kind) -> Family<'t> {
        self.header(name, help, kind.as_str());
        Family { text: self, name }
    }

    pub fn histogram(&mut self, name: &str, help: &str, h: &Histogram) {
        self.header(name, help, "histogram");
        let mut acc = 0;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            acc += c.load(Relaxed);
            let le = if b.is_infinite() { "+Inf".to_string() } else { b.to_string() };
            let _ = writeln!(self.out, "{name}_bucket{{le=\"{le}\"}} {acc}");
        }
        let _ = writeln!(self.out, "{name}_sum {}\n{name}_count {acc}", h.sum_micros.load(Relaxed) as f64 / 1e6);
    }

    pub fn finish(self) -> String {
        self.out
    }

    fn header(&mut self, name: &str, help: &str, kind: &str) {
        let _ = writeln!(self.out, "# HELP {name} {help}\n# TYPE {name} {kind}");
    }
}

pub struct Family<'t> {
    text: &'t mut Text,
    name: &'t str,
}

impl Family<'_> {
    /// One sample; label values are escaped, so they may hold anything.
    pub fn sample(&mut self, labels: &[(&str, &str)], value: impl Display) {
        let out = &mut self.text.out;
        out.push_str(self.name);
        if !labels.is_empty() {
            out.push('{');
            for (i, (k, v)) in labels.iter().enumerate() {
                let sep = if i == 0 { "" } else { "," };
                let _ = write!(out, "{sep}{k}=\"{}\"", escape(v));
            }
            out.push('}');
        }
        let _ = writeln!(out, " {value}");
    }
}

fn escape(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

/// Upper bounds of latency buckets, in seconds: from 5 ms (a decode step) to a minute.
pub const LATENCY_BUCKETS: [f64; 14] = [0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 60.0, f64::INFINITY];

/// Observations in seconds, counted per bucket (not cumulatively: rendering sums them).
pub struct Histogram {
    bounds: &'static [f64],
    counts: Vec<AtomicU64>,
    sum_micros: AtomicU64,
}

impl Histogram {
    /// `bounds` ascending and ending in infinity, so every observation has a bucket.
    pub fn new(bounds: &'static [f64]) -> Histogram {
        assert!(bounds.last() == Some(&f64::INFINITY), "a histogram's last bucket must be +Inf");
        Histogram { bounds, counts: bounds.iter().map(|_| AtomicU64::new(0)).collect(), sum_micros: AtomicU64::new(0) }
    }

    pub fn observe(&self, secs: f64) {
        let i = self.bounds.iter().position(|b| secs <= *b).unwrap_or(self.bounds.len() - 1);
        self.counts[i].fetch_add(1, Relaxed);
        self.sum_micros.fetch_add((secs * 1e6) as u64, Relaxed);
    }
}

impl Default for Histogram {
    fn default() -> Histogram {
        Histogram::new(&LATENCY_BUCKETS)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn writes_the_text_format_byte_for_byte() {
        let mut t = Text::new();
        t.metric("a_total", "Things done.", Kind::Counter, 3);
        t.metric("b_seconds_total", "Time spent.", Kind::Counter, 1.5);
        t.family("c", "Nothing yet.", Kind::Gauge);
        let mut f = t.family("d_total", "By kind.", Kind::Counter);
        f.sample(&[("kind", "x"), ("key", "q\"\\\nz")], 2);
        f.sample(&[("kind", "y")], 0);
        assert_eq!(
            t.finish(),
            "# HELP a_total Things done.\n# TYPE a_total counter\na_total 3\n\
             # HELP b_seconds_total Time spent.\n# TYPE b_seconds_total counter\nb_seconds_total 1.5\n\
             # HELP c Nothing yet.\n# TYPE c gauge\n\
             # HELP d_total By kind.\n# TYPE d_total counter\n\
             d_total{kind=\"x\",key=\"q\\\"\\\\\\nz\"} 2\nd_total{kind=\"y\"} 0\n"
        );
    }

    #[test]
    fn a_histogram_is_cumulative_and_ends_in_inf() {
        let h = Histogram::default();
        for s in [0.001, 0.004, 0.3, 0.5, 90.0] {
            h.observe(s);
        }
        let mut t = Text::new();
        t.histogram("h_seconds", "Latency.", &h);
        let text = t.finish();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines[..3], ["# HELP h_seconds Latency.", "# TYPE h_seconds histogram", "h_seconds_bucket{le=\"0.005\"} 2"]);
        assert!(lines.contains(&"h_seconds_bucket{le=\"0.2\"} 2"), "{text}");
        assert!(lines.contains(&"h_seconds_bucket{le=\"0.5\"} 4"), "{text}");
        assert!(lines.contains(&"h_seconds_bucket{le=\"1\"} 4"), "{text}");
        assert!(lines.contains(&"h_seconds_bucket{le=\"60\"} 4"), "{text}");
        assert_eq!(lines[lines.len() - 3..], ["h_seconds_bucket{le=\"+Inf\"} 5", "h_seconds_sum 90.805", "h_seconds_count 5"]);
    }
}
