//! Writes a run's results: `<out>/report.json` (summary + run settings) and
//! `<out>/requests.csv` (one row per request; `cached_tokens` is the server's count of
//! prompt tokens it found cached, empty when it reported none).

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
        "start_s,ttft_ms,itl_ms,e2e_ms,input_tokens,output_tokens,cached_tokens,error"
    )?;
    let ms = |x: Option<f64>| x.map(|v| format!("{:.3}", v * 1000.0)).unwrap_or_default();
    for r in records {
        writeln!(
            f,
            "{:.6},{},{},{:.3},{},{},{},{}",
            r.start,
            ms(r.ttft()),
            ms(r.itl()),
            r.e2e() * 1000.0,
            r.input_tokens,
            r.output_tokens,
            r.server_prompt
                .map(|(_, cached)| cached.to_string())
                .unwrap_or_default(),
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

/// Goodput and its SLA, or why there is none.
pub fn goodput_line(s: &Summary) -> String {
    let bound = |v: f64, name: &str| v.is_finite().then(|| format!("{name} <= {v} ms"));
    match s.sla {
        None => "goodput not measured: no SLA (--sla-ttft-ms, --sla-itl-ms)".to_string(),
        Some(sla) => {
            let bounds: Vec<String> = [bound(sla.ttft_ms, "TTFT"), bound(sla.itl_ms, "ITL")]
                .into_iter()
                .flatten()
                .collect();
            format!(
                "goodput {:.2} req/s ({} met the SLA: {})",
                s.goodput,
                s.sla_met,
                bounds.join(", ")
            )
        }
    }
}

/// Human-readable lines for the terminal.
pub fn print_summary(s: &Summary) {
    println!(
        "requests {} ok {} failed {} in {:.2} s",
        s.requests, s.succeeded, s.failed, s.duration_s
    );
    let rows = [
        ("TTFT", &s.ttft_ms),
        ("ITL", &s.itl_ms),
        ("gap", &s.gap_ms),
        ("E2E", &s.e2e_ms),
    ];
    for (name, d) in rows {
        println!(
            "{name:>5} ms  p50 {:9.2}  p90 {:9.2}  p99 {:9.2}  mean {:9.2}",
            d.p50, d.p90, d.p99, d.mean
        );
    }
    println!(
        "throughput {:.2} req/s, {:.1} output tok/s, {:.1} input tok/s; {}",
        s.request_throughput,
        s.output_token_throughput,
        s.input_token_throughput,
        goodput_line(s)
    );
    if let Some(rate) = s.prompt_cache_hit_rate {
        println!(
            "prompt cache hit rate {:.1}% (the server's cached_tokens)",
            rate * 100.0
        );
    }
    if !s.ended_by.is_empty() {
        println!("ended by: {}", s.ended_by);
    }
    if !s.errors.is_empty() {
        println!("errors {:?}", s.errors);
        for d in &s.error_samples {
            println!("  e.g. {d}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::stats::Sla;

    #[test]
    fn goodput_says_when_no_sla_was_given_and_which_one_was() {
        let none = Summary::default();
        assert_eq!(
            goodput_line(&none),
            "goodput not measured: no SLA (--sla-ttft-ms, --sla-itl-ms)"
        );
        let ttft_only = Summary {
            goodput: 2.5,
            sla_met: 5,
            sla: Some(Sla {
                ttft_ms: 200.0,
                itl_ms: f64::INFINITY,
            }),
            ..Summary::default()
        };
        assert_eq!(
            goodput_line(&ttft_only),
            "goodput 2.50 req/s (5 met the SLA: TTFT <= 200 ms)"
        );
    }
}
