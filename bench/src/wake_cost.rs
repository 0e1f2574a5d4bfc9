//! `warmroute-bench wake-cost`: what waking a sleeping thread costs the thread that wakes it,
//! on the same core and on another one.
//!
//! A reader thread pinned to `--reader-cpu` blocks in `read` on a pipe; the writer, pinned to
//! `--writer-cpu`, spins `--gap-us` (long enough for the reader to go back to sleep), then
//! times one 1-byte `write`, which wakes the reader. The write's time is the sender's cost of
//! a wake-up: on bare metal a microsecond or two either way; on a VM a wake-up of another
//! core is an inter-processor interrupt, which the hypervisor may charge tens of µs for. Every
//! packet a proxy sends on loopback wakes its reader this way, so this number explains much
//! of what a request costs on a given machine (`bench/RESULTS.md`).

use std::io::{Read, Write};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use serde_json::{json, Value};

use crate::{each_flag, num};

const USAGE: &str = "\
usage: warmroute-bench wake-cost [options]

Time a 1-byte pipe write that wakes a reader blocked on the other end, with the reader on
the writer's core and on another core.

options:
  --writer-cpu N   core of the writing thread (default 0)
  --reader-cpu N   the other core (default 1)
  --writes N       timed writes per placement (default 5000)
  --gap-us N       spin between writes, so the reader is asleep again (default 60)
  --out FILE       write the JSON result here instead of stdout
  --quiet          no summary line";

struct Opts {
    writer_cpu: usize,
    reader_cpu: usize,
    writes: usize,
    gap: Duration,
    out: Option<String>,
    quiet: bool,
}

fn parse(args: &[String]) -> Result<Option<Opts>, String> {
    let mut o = Opts {
        writer_cpu: 0,
        reader_cpu: 1,
        writes: 5000,
        gap: Duration::from_micros(60),
        out: None,
        quiet: false,
    };
    let Some(quiet) = each_flag(args.iter(), |flag, v| {
        match flag {
            "--writer-cpu" => o.writer_cpu = num(flag, &v)?,
            "--reader-cpu" => o.reader_cpu = num(flag, &v)?,
            "--writes" => o.writes = num::<usize>(flag, &v)?.max(1),
            "--gap-us" => o.gap = Duration::from_micros(num(flag, &v)?),
            "--out" => o.out = Some(v),
            _ => return Err(format!("unknown option {flag}")),
        }
        Ok(())
    })?
    else {
        return Ok(None);
    };
    o.quiet = quiet;
    Ok(Some(o))
}

fn pin(cpu: usize) -> Result<(), String> {
    if core_affinity::set_for_current(core_affinity::CoreId { id: cpu }) {
        Ok(())
    } else {
        Err(format!("cannot pin a thread to cpu {cpu}"))
    }
}

/// Nanoseconds per waking write, sorted, with the reader on `reader_cpu`.
fn measure(o: &Opts, reader_cpu: usize) -> Result<Vec<u64>, String> {
    let (mut rx, mut tx) = std::io::pipe().map_err(|e| format!("pipe: {e}"))?;
    let reader = std::thread::spawn(move || -> Result<(), String> {
        pin(reader_cpu)?;
        let mut b = [0u8; 1];
        // Ends when the writer closes its end.
        while rx.read(&mut b).map_err(|e| e.to_string())? == 1 {}
        Ok(())
    });
    pin(o.writer_cpu)?;
    let mut ns = Vec::with_capacity(o.writes);
    for i in 0..o.writes + 100 {
        let t = Instant::now();
        while t.elapsed() < o.gap {
            std::hint::spin_loop();
        }
        let t = Instant::now();
        tx.write_all(b"x").map_err(|e| format!("write: {e}"))?;
        // The first writes warm up the path.
        if i >= 100 {
            ns.push(t.elapsed().as_nanos() as u64);
        }
    }
    drop(tx);
    reader
        .join()
        .map_err(|_| "the reader panicked".to_string())??;
    ns.sort_unstable();
    Ok(ns)
}

fn stats(ns: &[u64]) -> Value {
    let at = |q: f64| ns[((ns.len() - 1) as f64 * q) as usize];
    json!({
        "writes": ns.len(),
        "mean_ns": ns.iter().sum::<u64>() / ns.len() as u64,
        "p50_ns": at(0.5),
        "p90_ns": at(0.9),
        "p99_ns": at(0.99),
    })
}

fn run(o: Opts) -> Result<Value, String> {
    let same = measure(&o, o.writer_cpu)?;
    let other = measure(&o, o.reader_cpu)?;
    Ok(json!({
        "writer_cpu": o.writer_cpu,
        "reader_cpu": o.reader_cpu,
        "gap_us": o.gap.as_micros() as u64,
        "same_core": stats(&same),
        "other_core": stats(&other),
    }))
}

pub fn main(args: &[String]) -> ExitCode {
    crate::run_cli(
        "warmroute-bench wake-cost",
        USAGE,
        parse(args),
        |o: &Opts| (o.out.clone(), o.quiet),
        run,
        |v| {
            format!(
                "  waking write, reader on the same core: p50 {} ns, mean {} ns; on cpu {}: p50 {} ns, mean {} ns",
                v["same_core"]["p50_ns"],
                v["same_core"]["mean_ns"],
                v["reader_cpu"],
                v["other_core"]["p50_ns"],
                v["other_core"]["mean_ns"],
            )
        },
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn options_and_a_short_run() {
        let a: Vec<String> = [
            "--writes",
            "50",
            "--gap-us",
            "20",
            "--reader-cpu",
            "0",
            "--quiet",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect();
        let o = parse(&a).unwrap().unwrap();
        assert_eq!(
            (o.writes, o.gap, o.reader_cpu, o.quiet),
            (50, Duration::from_micros(20), 0, true)
        );
        assert!(parse(&["--bogus".to_string(), "1".to_string()]).is_err());
        assert!(parse(&["--help".to_string()]).unwrap().is_none());
        // Both placements on core 0 (the one core every machine has): 50 timed writes each.
        let v = run(o).unwrap();
        assert_eq!(v["same_core"]["writes"], 50);
        assert_eq!(v["other_core"]["writes"], 50);
        assert!(v["same_core"]["p50_ns"].as_u64().unwrap() > 0);
    }
}
