//! Line charts, drawn by plotters as SVG. The SVG leaves its text to the viewer's fonts, so
//! drawing needs no font on this machine.

use crate::error::{BenchError, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::ops::Range;

/// One chart: what it shows, how its axes run, and a line per series.
pub struct Chart<'a> {
    pub title: &'a str,
    pub x_desc: &'a str,
    pub y_desc: &'a str,
    pub x: Range<f64>,
    pub y: Range<f64>,
    /// About how many ticks the x axis gets, and how each is labelled.
    pub x_ticks: usize,
    pub x_label: &'a dyn Fn(&f64) -> String,
    /// Where the legend goes: the corner the lines leave empty.
    pub legend: SeriesLabelPosition,
    pub lines: Vec<(&'a str, Vec<(f64, f64)>)>,
}

const COLORS: [RGBColor; 3] = [RGBColor(0x1f, 0x77, 0xb4), RGBColor(0xd6, 0x27, 0x28), RGBColor(0x2c, 0xa0, 0x2c)];

fn plot_error(e: impl std::fmt::Display) -> BenchError {
    BenchError::Plot(e.to_string())
}

/// The charts side by side, each `w` x `h` pixels, as one SVG document.
pub fn svg(charts: &[Chart], (w, h): (u32, u32)) -> Result<String> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (w * charts.len() as u32, h)).into_drawing_area();
        root.fill(&WHITE).map_err(plot_error)?;
        for (area, c) in root.split_evenly((1, charts.len())).iter().zip(charts) {
            draw(area, c)?;
        }
        root.present().map_err(plot_error)?;
    }
    Ok(out)
}

fn draw(area: &DrawingArea<SVGBackend, Shift>, c: &Chart) -> Result<()> {
    let mut chart = ChartBuilder::on(area)
        .caption(c.title, ("sans-serif", 14))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(c.x.clone(), c.y.clone())
        .map_err(plot_error)?;
    chart
        .configure_mesh()
        .x_desc(c.x_desc)
        .y_desc(c.y_desc)
        .x_labels(c.x_ticks)
        .x_label_formatter(c.x_label)
        .y_labels(5)
        .draw()
        .map_err(plot_error)?;
    for (i, (label, points)) in c.lines.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        chart
            // A missing measurement (NaN) is a gap, not a point at zero.
            .draw_series(LineSeries::new(points.iter().copied().filter(|(x, y)| x.is_finite() && y.is_finite()), color.stroke_width(2)))
            .map_err(plot_error)?
            .label(*label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .position(c.legend.clone())
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(plot_error)?;
    Ok(())
}
