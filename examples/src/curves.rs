//! Loss curves of several training runs, overlaid in one SVG.

use std::path::Path;

use plotters::prelude::*;

/// Draws each run's loss per step (`(label, losses)`) as one line of a
/// 800x480 SVG at `path`.
pub fn plot_losses(
    path: &Path,
    title: &str,
    runs: &[(String, Vec<f32>)],
) -> Result<(), Box<dyn std::error::Error>> {
    let steps = runs.iter().map(|(_, l)| l.len()).max().unwrap_or(1).max(2);
    let finite = || {
        runs.iter()
            .flat_map(|(_, l)| l.iter().copied())
            .filter(|v| v.is_finite())
    };
    let ymax = finite().fold(0f32, f32::max) as f64 * 1.05;
    let ymin = finite().fold(f32::MAX, f32::min).min(ymax as f32) as f64 * 0.95;
    let root = SVGBackend::new(path, (800, 480)).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 16))
        .margin(16)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0..steps, ymin..ymax.max(ymin + 1e-3))?;
    chart
        .configure_mesh()
        .x_desc("step")
        .y_desc("training loss (nats/char)")
        .draw()?;
    for (i, (label, losses)) in runs.iter().enumerate() {
        let color = Palette99::pick(i).stroke_width(if i == 0 { 3 } else { 1 });
        chart
            .draw_series(LineSeries::new(
                losses.iter().enumerate().map(|(s, &l)| (s, l as f64)),
                color,
            ))?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], Palette99::pick(i)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()?;
    Ok(())
}
