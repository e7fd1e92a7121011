//! SVG plots: latency CDFs of one run, and throughput against latency across a sweep.

use std::path::Path;

use plotters::prelude::*;

use crate::stats::{Record, Summary};

fn err(e: impl std::fmt::Display) -> anyhow::Error {
    anyhow::anyhow!("plotting: {e}")
}

/// Empirical CDFs of TTFT and E2E (ms) of the successful requests.
pub fn latency_cdf(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut series: Vec<(&str, Vec<f64>, RGBColor)> = vec![
        (
            "TTFT",
            records.iter().filter_map(|r| r.ttft()).collect(),
            BLUE,
        ),
        (
            "E2E",
            records.iter().filter(|r| r.ok()).map(|r| r.e2e()).collect(),
            RED,
        ),
    ];
    for s in series.iter_mut() {
        s.1.iter_mut().for_each(|x| *x *= 1000.0);
        s.1.sort_by(f64::total_cmp);
    }
    let xmax = series
        .iter()
        .filter_map(|s| s.1.last().copied())
        .fold(1.0, f64::max);
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Latency CDF", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..xmax * 1.05, 0f64..1.0)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("latency (ms)")
        .y_desc("fraction of requests")
        .draw()
        .map_err(err)?;
    for (name, v, color) in series {
        let n = v.len().max(1) as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, x)| (*x, (i + 1) as f64 / n))
            .collect();
        chart
            .draw_series(LineSeries::new(pts, color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Output-token throughput (x) against TTFT p50/p99 (y), one point per sweep step.
pub fn sweep(path: &Path, points: &[Summary]) -> anyhow::Result<()> {
    let xmax = points
        .iter()
        .map(|s| s.output_token_throughput)
        .fold(1.0, f64::max);
    let ymax = points.iter().map(|s| s.ttft_ms.p99).fold(1.0, f64::max);
    let root = SVGBackend::new(path, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption("Throughput vs TTFT", ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..xmax * 1.1, 0f64..ymax * 1.1)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("output tokens/s")
        .y_desc("TTFT (ms)")
        .draw()
        .map_err(err)?;
    type Pick = fn(&Summary) -> f64;
    let lines: [(&str, Pick, RGBColor); 2] = [
        ("TTFT p50", |s| s.ttft_ms.p50, BLUE),
        ("TTFT p99", |s| s.ttft_ms.p99, RED),
    ];
    for (name, pick, color) in lines {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|s| (s.output_token_throughput, pick(s)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(pts.into_iter().map(|p| Circle::new(p, 3, color.filled())))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
