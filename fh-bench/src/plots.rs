//! PNG and SVG plots (plotters). PNG text needs a TrueType font: one is looked up among the
//! usual system paths (Debian's `fonts-dejavu-core`) or taken from `FH_BENCH_FONT`, and
//! registered with plotters; without one, plots are not drawn and the report says why.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use plotters::coord::Shift;
use plotters::prelude::*;

/// Environment variable naming a `.ttf` file for plot text.
pub const FONT_ENV: &str = "FH_BENCH_FONT";

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/truetype/freefont/FreeSans.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
];

/// Registers a font for plot text once; `Err` says why plots cannot be drawn.
pub fn ensure_font() -> Result<PathBuf, String> {
    static FONT: OnceLock<Result<PathBuf, String>> = OnceLock::new();
    FONT.get_or_init(|| {
        let candidates: Vec<PathBuf> = std::env::var_os(FONT_ENV)
            .map(PathBuf::from)
            .into_iter()
            .chain(FONT_PATHS.iter().map(PathBuf::from))
            .collect();
        for p in &candidates {
            let Ok(bytes) = std::fs::read(p) else {
                continue;
            };
            let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
            if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_ok() {
                return Ok(p.clone());
            }
        }
        Err(format!(
            "no TrueType font found for plot text (looked for {FONT_ENV} and {}); install \
             fonts-dejavu-core or set {FONT_ENV}=/path/to/font.ttf",
            FONT_PATHS[0]
        ))
    })
    .clone()
}

/// A line series: label and (x, y) points.
pub type Series = (String, Vec<(f64, f64)>);

/// A line chart's description.
pub struct LineChart<'a> {
    /// Title.
    pub title: &'a str,
    /// X axis label.
    pub x_label: &'a str,
    /// Y axis label.
    pub y_label: &'a str,
    /// Logarithmic x axis (base 2 ticks formatted as sizes when `x_bytes`).
    pub log_x: bool,
    /// Logarithmic y axis.
    pub log_y: bool,
    /// Format x ticks as byte sizes.
    pub x_bytes: bool,
    /// The series.
    pub series: Vec<Series>,
}

/// Writes `<stem>.png` and `<stem>.svg`; returns their file names.
pub fn line_chart(dir: &Path, stem: &str, chart: &LineChart<'_>) -> Result<Vec<String>, String> {
    ensure_font()?;
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, (1000, 620)).into_drawing_area();
        draw_lines(&root, chart).map_err(|e| format!("drawing {}: {e}", png.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, (1000, 620)).into_drawing_area();
        draw_lines(&root, chart).map_err(|e| format!("drawing {}: {e}", svg.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    }
    Ok(vec![format!("{stem}.png"), format!("{stem}.svg")])
}

/// Several line charts side by side in a grid (`cols` columns), one file pair.
pub fn line_grid(
    dir: &Path,
    stem: &str,
    title: &str,
    cols: usize,
    charts: &[LineChart<'_>],
) -> Result<Vec<String>, String> {
    ensure_font()?;
    let rows = charts.len().div_ceil(cols.max(1)).max(1);
    let size = (560 * cols as u32, 400 * rows as u32 + 40);
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, size).into_drawing_area();
        draw_grid(&root, title, rows, cols, charts)
            .map_err(|e| format!("drawing {}: {e}", png.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, size).into_drawing_area();
        draw_grid(&root, title, rows, cols, charts)
            .map_err(|e| format!("drawing {}: {e}", svg.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    }
    Ok(vec![format!("{stem}.png"), format!("{stem}.svg")])
}

type DrawResult = Result<(), String>;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("{e:?}")
}

fn draw_grid<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    rows: usize,
    cols: usize,
    charts: &[LineChart<'_>],
) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let body = root.titled(title, ("sans-serif", 24)).map_err(err)?;
    let areas = body.split_evenly((rows, cols));
    for (area, chart) in areas.iter().zip(charts) {
        draw_lines(area, chart)?;
    }
    Ok(())
}

/// Readable byte size: 8 B, 4 KiB, 16 MiB.
pub fn fmt_bytes(b: f64) -> String {
    let units = ["B", "KiB", "MiB", "GiB"];
    let mut v = b;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < units.len() {
        v /= 1024.0;
        i += 1;
    }
    if (v - v.round()).abs() < 1e-9 {
        format!("{} {}", v.round(), units[i])
    } else {
        format!("{v:.1} {}", units[i])
    }
}

fn bounds(series: &[Series], log: bool, x: bool) -> (f64, f64) {
    let vals = series
        .iter()
        .flat_map(|(_, pts)| pts.iter().map(move |p| if x { p.0 } else { p.1 }))
        .filter(|v| v.is_finite() && (!log || *v > 0.0));
    let (mut lo, mut hi) = vals.fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
        (a.min(v), b.max(v))
    });
    if !lo.is_finite() {
        return (1.0, 10.0);
    }
    if log {
        lo /= 1.5;
        hi *= 1.5;
    } else {
        lo = lo.min(0.0);
        hi = if hi <= lo { lo + 1.0 } else { hi * 1.08 };
    }
    (lo, hi)
}

fn draw_lines<DB: DrawingBackend>(root: &DrawingArea<DB, Shift>, c: &LineChart<'_>) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let (x0, x1) = bounds(&c.series, c.log_x, true);
    let (y0, y1) = bounds(&c.series, c.log_y, false);
    let mut b = ChartBuilder::on(root);
    b.caption(c.title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(70);
    macro_rules! finish {
        ($chart:expr) => {{
            let mut chart = $chart;
            let x_bytes = c.x_bytes;
            let fmt_x = move |v: &f64| {
                if x_bytes {
                    fmt_bytes(*v)
                } else if *v >= 100.0 || (*v - v.round()).abs() < 1e-9 {
                    format!("{}", v.round())
                } else {
                    format!("{v:.2}")
                }
            };
            chart
                .configure_mesh()
                .x_desc(c.x_label)
                .y_desc(c.y_label)
                .x_label_formatter(&fmt_x)
                .label_style(("sans-serif", 14))
                .axis_desc_style(("sans-serif", 15))
                .draw()
                .map_err(err)?;
            for (i, (label, pts)) in c.series.iter().enumerate() {
                let color = Palette99::pick(i).to_rgba();
                let pts: Vec<(f64, f64)> = pts
                    .iter()
                    .copied()
                    .filter(|p| p.0.is_finite() && p.1.is_finite() && (!c.log_y || p.1 > 0.0))
                    .collect();
                chart
                    .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
                    .map_err(err)?
                    .label(label.as_str())
                    .legend(move |(x, y)| {
                        PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2))
                    });
                chart
                    .draw_series(pts.iter().map(|p| Circle::new(*p, 3, color.filled())))
                    .map_err(err)?;
            }
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperLeft)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK.mix(0.4))
                .label_font(("sans-serif", 13))
                .draw()
                .map_err(err)?;
        }};
    }
    let xb = if c.x_bytes { 4.0 } else { 10.0 };
    match (c.log_x, c.log_y) {
        (true, true) => finish!(b
            .build_cartesian_2d((x0..x1).log_scale().base(xb), (y0..y1).log_scale())
            .map_err(err)?),
        (true, false) => finish!(b
            .build_cartesian_2d((x0..x1).log_scale().base(xb), y0..y1)
            .map_err(err)?),
        (false, true) => finish!(b
            .build_cartesian_2d(x0..x1, (y0..y1).log_scale())
            .map_err(err)?),
        (false, false) => finish!(b.build_cartesian_2d(x0..x1, y0..y1).map_err(err)?),
    }
    Ok(())
}

/// Grouped bars: for each group (x label), one bar per series; writes PNG and SVG.
pub fn bar_chart(
    dir: &Path,
    stem: &str,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
) -> Result<Vec<String>, String> {
    ensure_font()?;
    let png = dir.join(format!("{stem}.png"));
    let svg = dir.join(format!("{stem}.svg"));
    {
        let root = BitMapBackend::new(&png, (1000, 620)).into_drawing_area();
        draw_bars(&root, title, y_label, groups, series)
            .map_err(|e| format!("drawing {}: {e}", png.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", png.display()))?;
    }
    {
        let root = SVGBackend::new(&svg, (1000, 620)).into_drawing_area();
        draw_bars(&root, title, y_label, groups, series)
            .map_err(|e| format!("drawing {}: {e}", svg.display()))?;
        root.present()
            .map_err(|e| format!("writing {}: {e}", svg.display()))?;
    }
    Ok(vec![format!("{stem}.png"), format!("{stem}.svg")])
}

fn draw_bars<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
) -> DrawResult {
    root.fill(&WHITE).map_err(err)?;
    let ymax = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-9)
        * 1.15;
    let n = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 20))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(70)
        .build_cartesian_2d(0.0..n, 0.0..ymax)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .disable_x_axis()
        .y_desc(y_label)
        .label_style(("sans-serif", 14))
        .axis_desc_style(("sans-serif", 15))
        .draw()
        .map_err(err)?;
    let k = series.len().max(1) as f64;
    let w = 0.8 / k;
    for (j, (label, vals)) in series.iter().enumerate() {
        let color = Palette99::pick(j).to_rgba();
        let bars: Vec<Rectangle<(f64, f64)>> = vals
            .iter()
            .enumerate()
            .filter(|(_, v)| v.is_finite())
            .map(|(i, v)| {
                let x = i as f64 + 0.1 + j as f64 * w;
                Rectangle::new([(x, 0.0), (x + w * 0.92, *v)], color.filled())
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(label.as_str())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], color.filled()));
    }
    // Group names under the axis, centred on each group (pixel positions).
    for (i, g) in groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(i as f64 + 0.5, 0.0));
        let half = (g.chars().count() as i32) * 4;
        root.draw(&Text::new(
            g.clone(),
            (px - half, py + 10),
            ("sans-serif", 16).into_font().color(&BLACK),
        ))
        .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK.mix(0.4))
        .label_font(("sans-serif", 13))
        .draw()
        .map_err(err)?;
    Ok(())
}
