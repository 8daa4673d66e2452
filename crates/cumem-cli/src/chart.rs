//! Line charts written as SVG: the one drawing routine behind `--svg` of `replay` and `bench`.

use std::path::Path;

use plotters::prelude::*;

/// One line of a chart.
pub struct Series {
    /// Its legend entry.
    pub label: String,
    /// Its colour.
    pub color: RGBColor,
    /// Points in data coordinates, in drawing order.
    pub points: Vec<(f64, f64)>,
    /// Drawn dashed and thinner, over the solid lines, so that a solid line it coincides with still
    /// shows through its gaps.
    pub dashed: bool,
}

/// What the axes say and how their ticks read.
pub struct Axes<'a> {
    /// The caption above the plot.
    pub title: &'a str,
    /// The horizontal axis's description.
    pub x_label: &'a str,
    /// The vertical axis's description.
    pub y_label: &'a str,
    /// Formats an x tick.
    pub x_ticks: &'a dyn Fn(&f64) -> String,
    /// Formats a y tick.
    pub y_ticks: &'a dyn Fn(&f64) -> String,
}

/// Creates (or truncates) the chart's file now, so a path that cannot be written fails before any
/// measuring is done rather than after.
pub fn check_writable(path: &Path) -> Result<(), String> {
    std::fs::File::create(path).map(drop).map_err(|e| format!("{}: {e}", path.display()))
}

/// Draws `series` into an SVG file at `path`, with labelled axes and a legend. When drawing fails
/// the file is removed, so no partial chart is left behind.
pub fn line_chart(path: &Path, axes: &Axes<'_>, series: &[Series]) -> Result<(), String> {
    draw(path, axes, series).map_err(|e| {
        if let Err(removing) = std::fs::remove_file(path) {
            tracing::warn!(path = %path.display(), error = %removing, "could not remove a partial chart");
        }
        format!("drawing {}: {e}", path.display())
    })
}

fn draw(path: &Path, axes: &Axes<'_>, series: &[Series]) -> Result<(), Box<dyn std::error::Error>> {
    // Non-finite points (an infinite GB/s from a zero-length timing) are left out of the bounds:
    // plotters 0.3.7 loops forever computing key points on a range with an infinity or NaN in it.
    let points =
        || series.iter().flat_map(|s| s.points.iter()).filter(|p| p.0.is_finite() && p.1.is_finite());
    let (x_min, x_max) =
        points().fold((f64::INFINITY, f64::NEG_INFINITY), |(lo, hi), p| (lo.min(p.0), hi.max(p.0)));
    let y_max = points().fold(0.0f64, |hi, p| hi.max(p.1));
    let (x_min, x_max) = if !x_min.is_finite() || !x_max.is_finite() {
        // No point at all (a header-only trace).
        (0.0, 1.0)
    } else if x_min < x_max {
        (x_min, x_max)
    } else {
        (0.0, x_min.max(0.0) + 1.0)
    };
    let y_max = if y_max > 0.0 { y_max * 1.1 } else { 1.0 };

    let root = SVGBackend::new(path, (1100, 650)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(axes.title, ("sans-serif", 26))
        .margin(20)
        .x_label_area_size(50)
        .y_label_area_size(90)
        .build_cartesian_2d(x_min..x_max, 0.0..y_max)?;
    chart
        .configure_mesh()
        .label_style(("sans-serif", 15))
        .axis_desc_style(("sans-serif", 17))
        .x_desc(axes.x_label)
        .y_desc(axes.y_label)
        .x_label_formatter(axes.x_ticks)
        .y_label_formatter(axes.y_ticks)
        .draw()?;
    // Solid lines first, dashed ones over them: a dashed line that lies on a solid one (live bytes
    // on a strategy that reserves no more) stays visible, and so does the solid line in its gaps.
    for s in series.iter().filter(|s| !s.dashed).chain(series.iter().filter(|s| s.dashed)) {
        let finite = s.points.iter().copied().filter(|p| p.0.is_finite() && p.1.is_finite());
        let style = ShapeStyle {
            color: s.color.to_rgba(),
            filled: false,
            stroke_width: if s.dashed { 2 } else { 3 },
        };
        let drawn = if s.dashed {
            chart.draw_series(DashedLineSeries::new(finite, 10, 6, style))?
        } else {
            chart.draw_series(LineSeries::new(finite, style))?
        };
        drawn
            .label(s.label.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 24, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .label_font(("sans-serif", 15))
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
