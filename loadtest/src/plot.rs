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

/// Output-token throughput (x) against TTFT and against ITL (y, p50 and p99), one point per
/// sweep step, each labelled with its step (`c8` for concurrency 8, `r2.5` for 2.5 req/s).
pub fn sweep(path: &Path, points: &[(String, Summary)]) -> anyhow::Result<()> {
    let root = SVGBackend::new(path, (1200, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let panels = root.split_evenly((1, 2));
    type Pick = fn(&Summary) -> f64;
    let metrics: [(&str, Pick, Pick); 2] = [
        ("TTFT", |s| s.ttft_ms.p50, |s| s.ttft_ms.p99),
        ("ITL", |s| s.itl_ms.p50, |s| s.itl_ms.p99),
    ];
    for (area, (name, p50, p99)) in panels.iter().zip(metrics) {
        sweep_panel(area, points, name, [p50, p99])?;
    }
    root.present().map_err(err)?;
    Ok(())
}

/// A sweep step's short label: `concurrency 8` → `c8`, `rate 2.5` → `r2.5`.
fn short_label(step: &str) -> String {
    match step.split_once(' ') {
        Some((kind, value)) => format!("{}{value}", &kind[..1]),
        None => step.to_string(),
    }
}

fn sweep_panel(
    area: &DrawingArea<SVGBackend<'_>, plotters::coord::Shift>,
    points: &[(String, Summary)],
    name: &str,
    picks: [fn(&Summary) -> f64; 2],
) -> anyhow::Result<()> {
    let xmax = points
        .iter()
        .map(|(_, s)| s.output_token_throughput)
        .fold(1.0, f64::max);
    let ymax = points.iter().map(|(_, s)| picks[1](s)).fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(area)
        .caption(format!("Throughput vs {name}"), ("sans-serif", 20))
        .margin(10)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d(0f64..xmax * 1.15, 0f64..ymax * 1.15)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc("output tokens/s")
        .y_desc(format!("{name} (ms)"))
        .draw()
        .map_err(err)?;
    for (pick, pct, color) in [(picks[0], "p50", BLUE), (picks[1], "p99", RED)] {
        let pts: Vec<(f64, f64)> = points
            .iter()
            .map(|(_, s)| (s.output_token_throughput, pick(s)))
            .collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(format!("{name} {pct}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(pts.into_iter().zip(points).map(|(p, (step, _))| {
                EmptyElement::at(p)
                    + Circle::new((0, 0), 3, color.filled())
                    + Text::new(short_label(step), (5, -14), ("sans-serif", 12))
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .border_style(BLACK)
        .background_style(WHITE)
        .draw()
        .map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Dist;

    #[test]
    fn the_sweep_plots_ttft_and_itl_with_labelled_points() {
        let step = |c: usize, tps: f64, ttft: f64, itl: f64| {
            let d = |v: f64| Dist {
                p50: v,
                p99: 2.0 * v,
                ..Dist::default()
            };
            (
                format!("concurrency {c}"),
                Summary {
                    output_token_throughput: tps,
                    ttft_ms: d(ttft),
                    itl_ms: d(itl),
                    ..Summary::default()
                },
            )
        };
        let dir = std::env::temp_dir().join(format!("tandem-sweep-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("sweep.svg");
        sweep(
            &path,
            &[step(1, 100.0, 20.0, 5.0), step(16, 900.0, 80.0, 12.0)],
        )
        .unwrap();
        // Texts as the SVG holds them, whitespace (line breaks around a text's content) left out.
        let svg: String = std::fs::read_to_string(&path)
            .unwrap()
            .split_whitespace()
            .collect();
        for text in [
            "ThroughputvsTTFT",
            "ThroughputvsITL",
            ">c1<",
            ">c16<",
            ">ITLp99<",
        ] {
            assert!(svg.contains(text), "{text} missing from the plot");
        }
        assert_eq!(short_label("rate 2.5"), "r2.5");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
