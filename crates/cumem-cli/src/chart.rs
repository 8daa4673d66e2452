//! Line charts written as SVG: the one drawing routine behind `--svg` of `replay` and `bench`.

use std::path::{Path, PathBuf};

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

/// A chart's file while the command runs. The chart is drawn into a temporary file beside it, which
/// replaces the file only once the chart is complete: a command that fails, or a drawing that
/// fails, leaves an earlier chart at the path as it was. Dropped unused, the temporary file goes
/// (a process killed by a signal leaves it; the next run at that path replaces it). A symbolic
/// link at the path is replaced by the chart, not followed.
pub struct ChartFile {
    path: PathBuf,
    temp: PathBuf,
    /// The temporary file, opened once by `create`: the chart is written through it.
    file: std::fs::File,
    placed: bool,
}

impl ChartFile {
    /// Creates the temporary file now, so that a path that cannot be written (no such directory, no
    /// permission) fails before any measuring is done rather than after; the file at `path` itself
    /// is not touched until [`line_chart`](ChartFile::line_chart) succeeds.
    pub fn create(path: &Path) -> Result<ChartFile, String> {
        let failed = |e: &dyn std::fmt::Display| format!("{}: {e}", path.display());
        let name = path.file_name().ok_or_else(|| failed(&"not a file name"))?;
        if path.is_dir() {
            return Err(failed(&"is a directory"));
        }
        // Hidden, and named by this process: two runs charting to one path do not share it.
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(name);
        temp_name.push(format!(".{}.tmp", std::process::id()));
        let temp = path.with_file_name(temp_name);
        // `create_new`: never truncate, nor write through a link at, a file that happens to have
        // the name (a run killed before it cleaned up leaves its temporary file behind).
        if temp.symlink_metadata().is_ok() {
            std::fs::remove_file(&temp).map_err(|e| failed(&e))?;
        }
        let file =
            std::fs::OpenOptions::new().write(true).create_new(true).open(&temp).map_err(|e| failed(&e))?;
        Ok(ChartFile { path: path.to_owned(), temp, file, placed: false })
    }

    /// Where the chart goes.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Draws `series` with labelled axes and a legend, then puts the chart at its path (replacing
    /// what was there in one rename). On failure no partial chart is left behind, and the path
    /// keeps what it had.
    pub fn line_chart(mut self, axes: &Axes<'_>, series: &[Series]) -> Result<(), String> {
        let svg = draw(axes, series).map_err(|e| format!("drawing {}: {e}", self.path.display()))?;
        std::io::Write::write_all(&mut self.file, svg.as_bytes())
            .and_then(|()| self.file.sync_all())
            .map_err(|e| format!("{}: {e}", self.temp.display()))?;
        std::fs::rename(&self.temp, &self.path).map_err(|e| format!("{}: {e}", self.path.display()))?;
        self.placed = true;
        Ok(())
    }
}

impl Drop for ChartFile {
    fn drop(&mut self) {
        if self.placed {
            return;
        }
        match std::fs::remove_file(&self.temp) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %self.temp.display(), error = %e, "could not remove an unfinished chart")
            }
        }
    }
}

/// Whether `a` and `b` name one file (one device and inode: hard links and symbolic links
/// included); `false` where either does not exist.
pub fn same_file(a: &Path, b: &Path) -> bool {
    #[cfg(unix)]
    {
        use std::os::unix::fs::MetadataExt;
        match (std::fs::metadata(a), std::fs::metadata(b)) {
            (Ok(a), Ok(b)) => a.dev() == b.dev() && a.ino() == b.ino(),
            _ => false,
        }
    }
    #[cfg(not(unix))]
    {
        matches!((std::fs::canonicalize(a), std::fs::canonicalize(b)), (Ok(a), Ok(b)) if a == b)
    }
}

/// The chart as SVG text (written through the file handle `ChartFile` made, never reopened by
/// name: plotters' own file output would follow a link put at the temporary name meanwhile).
fn draw(axes: &Axes<'_>, series: &[Series]) -> Result<String, Box<dyn std::error::Error>> {
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

    let mut svg = String::new();
    let root = SVGBackend::with_string(&mut svg, (1100, 650)).into_drawing_area();
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
    drop(chart);
    drop(root);
    Ok(svg)
}
