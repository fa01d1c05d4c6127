//! A small `--flag value` parser for the example programs (no dependency).

use std::collections::{BTreeMap, BTreeSet};
use std::str::FromStr;

/// Command-line flags: `--name value` or `--name=value`.
#[derive(Debug, Default)]
pub struct Flags {
    values: BTreeMap<String, String>,
    known: BTreeSet<String>,
}

impl Flags {
    /// Parses `args` (without the program name). `--help` and `-h` give
    /// `Err(None)`; a malformed line gives `Err(Some(message))`.
    pub fn parse(args: impl IntoIterator<Item = String>) -> Result<Self, Option<String>> {
        let mut values = BTreeMap::new();
        let mut args = args.into_iter();
        while let Some(arg) = args.next() {
            if arg == "--help" || arg == "-h" {
                return Err(None);
            }
            let Some(flag) = arg.strip_prefix("--") else {
                return Err(Some(format!("unexpected argument `{arg}`")));
            };
            let (name, value) = match flag.split_once('=') {
                Some((n, v)) => (n.to_string(), v.to_string()),
                None => {
                    let v = args
                        .next()
                        .ok_or_else(|| Some(format!("--{flag} needs a value")))?;
                    (flag.to_string(), v)
                }
            };
            values.insert(name, value);
        }
        Ok(Flags {
            values,
            known: BTreeSet::new(),
        })
    }

    /// The program's own arguments; on `--help`, prints `usage` and exits.
    pub fn from_env(usage: &str) -> Result<Self, String> {
        match Flags::parse(std::env::args().skip(1)) {
            Ok(f) => Ok(f),
            Err(None) => {
                print!("{usage}");
                std::process::exit(0);
            }
            Err(Some(e)) => Err(e),
        }
    }

    /// The value of `--name`, or `default`.
    pub fn get<T: FromStr>(&mut self, name: &str, default: T) -> Result<T, String>
    where
        T::Err: std::fmt::Display,
    {
        Ok(self.opt(name)?.unwrap_or(default))
    }

    /// The value of `--name`, if given.
    pub fn opt<T: FromStr>(&mut self, name: &str) -> Result<Option<T>, String>
    where
        T::Err: std::fmt::Display,
    {
        self.known.insert(name.to_string());
        self.values
            .get(name)
            .map(|v| v.parse().map_err(|e| format!("--{name} {v}: {e}")))
            .transpose()
    }

    /// Fails on flags no [`Flags::get`] or [`Flags::opt`] asked for.
    pub fn finish(self) -> Result<(), String> {
        let unknown: Vec<String> = self
            .values
            .keys()
            .filter(|k| !self.known.contains(*k))
            .map(|k| format!("--{k}"))
            .collect();
        if unknown.is_empty() {
            Ok(())
        } else {
            Err(format!(
                "unknown flag(s) {} (try --help)",
                unknown.join(", ")
            ))
        }
    }
}

/// The device named `cpu` or `cuda` (`cuda` needs the `cuda` feature).
pub fn device(name: &str) -> Result<candle_core::Device, String> {
    match name {
        "cpu" => Ok(candle_core::Device::Cpu),
        "cuda" => candle_core::Device::new_cuda(0).map_err(|e| {
            format!("--device cuda: {e} (build with `--features cuda` on a machine with CUDA)")
        }),
        other => Err(format!("unknown device `{other}`: expected cpu or cuda")),
    }
}
