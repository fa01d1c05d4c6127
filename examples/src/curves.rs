//! Per-step curves of several runs, overlaid in one SVG (the loss curves of
//! `train_gpt --plot`, the live bytes of `soak`).

use std::ops::Range;
use std::path::Path;

use plotters::prelude::*;

/// Draws each run's value per step (`(label, values)`, the first value at
/// step 1) as one labelled line of an 800x480 SVG at `path`, `y` the
/// vertical range. The first run is drawn thick, the others thin over it,
/// so that curves that coincide stay visible as one.
pub fn plot_steps(
    path: &Path,
    title: &str,
    y_desc: &str,
    y: Range<f64>,
    runs: &[(String, Vec<f64>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let steps = runs.iter().map(|(_, v)| v.len()).max().unwrap_or(1).max(2);
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(64)
        .build_cartesian_2d(1..steps, y)?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc(y_desc)
        .draw()?;
    for (i, (label, values)) in runs.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(
                values.iter().enumerate().map(|(s, &v)| (s + 1, v)),
                color.stroke_width(if i == 0 { 3 } else { 1 }),
            ))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
