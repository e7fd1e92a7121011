//! Writes a run's results: `<out>/report.json` (summary + run settings) and
//! `<out>/requests.csv` (one row per request).

use std::io::Write;
use std::path::Path;

use serde::Serialize;

use crate::stats::{Record, Summary};

#[derive(Serialize)]
pub struct Report<'a, S: Serialize> {
    pub settings: &'a S,
    pub summary: &'a Summary,
}

pub fn write_json<S: Serialize>(
    path: &Path,
    settings: &S,
    summary: &Summary,
) -> anyhow::Result<()> {
    let text = serde_json::to_string_pretty(&Report { settings, summary })?;
    std::fs::write(path, text)?;
    Ok(())
}

pub fn write_csv(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    writeln!(
        f,
        "start_s,ttft_ms,itl_ms,e2e_ms,input_tokens,output_tokens,error"
    )?;
    let ms = |x: Option<f64>| x.map(|v| format!("{:.3}", v * 1000.0)).unwrap_or_default();
    for r in records {
        writeln!(
            f,
            "{:.6},{},{},{:.3},{},{},{}",
            r.start,
            ms(r.ttft()),
            ms(r.itl()),
            r.e2e() * 1000.0,
            r.input_tokens,
            r.output_tokens,
            r.error.as_deref().unwrap_or("")
        )?;
    }
    f.flush()?;
    Ok(())
}

/// `outputs.jsonl`: one line per successful request with a recorded output.
pub fn write_outputs(path: &Path, records: &[Record]) -> anyhow::Result<()> {
    let mut f = std::io::BufWriter::new(std::fs::File::create(path)?);
    for out in records
        .iter()
        .filter(|r| r.ok())
        .filter_map(|r| r.output.as_ref())
    {
        serde_json::to_writer(&mut f, out)?;
        writeln!(f)?;
    }
    f.flush()?;
    Ok(())
}

/// Human-readable lines for the terminal.
pub fn print_summary(s: &Summary) {
    println!(
        "requests {} ok {} failed {} in {:.2} s",
        s.requests, s.succeeded, s.failed, s.duration_s
    );
    for (name, d) in [("TTFT", &s.ttft_ms), ("ITL", &s.itl_ms), ("E2E", &s.e2e_ms)] {
        println!(
            "{name:>5} ms  p50 {:9.2}  p90 {:9.2}  p99 {:9.2}  mean {:9.2}",
            d.p50, d.p90, d.p99, d.mean
        );
    }
    println!(
        "throughput {:.2} req/s, {:.1} output tok/s, {:.1} input tok/s; goodput {:.2} req/s ({} met the SLA)",
        s.request_throughput, s.output_token_throughput, s.input_token_throughput, s.goodput, s.sla_met
    );
    if !s.errors.is_empty() {
        println!("errors {:?}", s.errors);
        for d in &s.error_samples {
            println!("  e.g. {d}");
        }
    }
}
