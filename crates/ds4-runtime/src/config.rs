//! [`Config`]: the settings of a run that are neither model-file facts nor placement
//! (which `ds4_placement::resolve_overrides` resolves the same way), read once at start
//! from the flags and the environment — flag > variable > default, every value with where
//! it came from — so `ds4 --print-config` and the `-v` load log can say what a run uses and
//! why. Nothing below the binaries reads these variables again: the GPU backend gets its
//! share as [`ds4_gpu::backend::Knobs`].
//!
//! On/off variables are read by the one parser every crate uses
//! ([`ds4_placement::parse_switch`]); a value that cannot be read is an error naming the
//! variable, never a silent default.

use std::fmt::Write as _;

use ds4_gpu::backend::{Knobs, LoadConfig, PrefillTiles};
use ds4_placement::request::{OverrideError, Overrides, Setting, Source};
use ds4_placement::resolve_switch;

use crate::draft::{DraftConfig, DraftMode, DEFAULT_DRAFT_MAX, DEFAULT_DRAFT_NGRAM, MAX_DRAFT_MAX};
use crate::load::Precision;

/// `DS4_QUALITY`: [`Precision::Quality`] when on (as `--quality`).
pub const QUALITY_ENV: &str = "DS4_QUALITY";
/// `DS4_WARMUP`: the warm-up at load; off as `--no-warmup`.
pub const WARMUP_ENV: &str = "DS4_WARMUP";
/// `DS4_PREFILL_TILES=off|experts|all`: which multi-token matmuls run on quantized tiles
/// (docs/gpu.md §4); `--quality` always takes the f32 panels.
pub const PREFILL_TILES_ENV: &str = "DS4_PREFILL_TILES";
/// `DS4_EXPERT_READAHEAD`: reading the next layer's predicted experts ahead when experts
/// are streamed (docs/placement.md §9).
pub const EXPERT_READAHEAD_ENV: &str = "DS4_EXPERT_READAHEAD";
/// `DS4_CUDA_PROFILE`: per-kernel launch counts and synchronised times at exit (GPU).
pub const PROFILE_ENV: &str = "DS4_CUDA_PROFILE";
/// `DS4_LOAD_THREADS`: reader threads of the GPU weight load.
pub const LOAD_THREADS_ENV: &str = "DS4_LOAD_THREADS";
/// `DS4_LOAD_STAGING_MIB`: the GPU weight load's pinned staging ring, MiB.
pub const LOAD_STAGING_ENV: &str = "DS4_LOAD_STAGING_MIB";

/// `DS4_DRAFT=off|mtp|lookup|auto`: the drafter of speculative decoding (docs/speculative.md).
pub const DRAFT_ENV: &str = "DS4_DRAFT";
/// `DS4_DRAFT_MAX`: most drafted tokens per step.
pub const DRAFT_MAX_ENV: &str = "DS4_DRAFT_MAX";
/// `DS4_MTP`: the file holding the MTP block (`mtp.0.*`; ds4's sidecar), as `--mtp`.
pub const MTP_ENV: &str = "DS4_MTP";
/// `DS4_DRAFT_NGRAM`: the longest suffix the lookup drafter matches.
pub const DRAFT_NGRAM_ENV: &str = "DS4_DRAFT_NGRAM";
/// The longest suffix `--draft-ngram` accepts (longer ones almost never match where a
/// shorter one would not).
pub const MAX_DRAFT_NGRAM: usize = 16;

/// The flags of a binary that [`Config::resolve`] weighs against the environment.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ConfigFlags {
    /// `--quality`.
    pub quality: bool,
    /// `--no-warmup`.
    pub no_warmup: bool,
    /// `--draft`.
    pub draft: Option<DraftMode>,
    /// `--draft-max`.
    pub draft_max: Option<usize>,
    /// `--draft-ngram`.
    pub draft_ngram: Option<usize>,
}

/// The run's settings, each with its source (see the module doc).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// Fast (int8 decode activations, TF32 / half-precision tiles at prefill) or quality
    /// (f32 throughout).
    pub precision: Setting<Precision>,
    /// Warm up at load (a prefill chunk and a decode step, so the first request does not
    /// pay the GPU's first-use costs).
    pub warmup: Setting<bool>,
    /// Multi-token matmuls on quantized tiles (always off under quality).
    pub prefill_tiles: Setting<PrefillTiles>,
    /// Read-ahead of streamed experts.
    pub expert_readahead: Setting<bool>,
    /// Per-kernel profile of the GPU backend.
    pub profile: Setting<bool>,
    /// Reader threads of the GPU weight load.
    pub load_threads: Setting<usize>,
    /// Pinned staging ring of the GPU weight load, MiB.
    pub load_staging_mib: Setting<usize>,
    /// The drafter of speculative decoding (off: one token per forward pass).
    pub draft: Setting<DraftMode>,
    /// Most drafted tokens per step.
    pub draft_max: Setting<usize>,
    /// The longest suffix n-gram the lookup drafter matches.
    pub draft_ngram: Setting<usize>,
    /// The file holding the MTP block (`--mtp`, `DS4_MTP`); without one, the model file's
    /// own `mtp.0.*` tensors when it has them (loaded for `--draft mtp|auto`).
    pub mtp: Setting<Option<std::path::PathBuf>>,
}

impl Default for Config {
    /// Every setting at its default: what a run without flags or variables uses.
    fn default() -> Config {
        Config::from_flags(ConfigFlags::default())
    }
}

fn env_source(var: &str, value: &str) -> Source {
    Source::Env {
        var: var.to_string(),
        value: value.to_string(),
    }
}

/// A positive count from `var`, else `default`.
fn count(
    var: &str,
    default: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<usize>, OverrideError> {
    match env(var) {
        None => Ok(Setting::new(default, Source::Default)),
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(Setting::new(n, env_source(var, &v))),
            _ => Err(OverrideError::BadValue {
                name: var.to_string(),
                value: v,
                expected: "a positive integer",
            }),
        },
    }
}

/// A count in `1..=max` from its flag, else its variable, else `default`; the variable is
/// parsed either way (a typo is reported even where the flag decides).
fn bounded(
    flag: Option<(&str, usize)>,
    var: &str,
    default: usize,
    max: usize,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<usize>, OverrideError> {
    let expected = "an integer from 1 to the setting's maximum (docs/configuration.md)";
    let from_env = match env(var) {
        None => None,
        Some(v) => match v.trim().parse::<usize>() {
            Ok(n) if (1..=max).contains(&n) => Some(Setting::new(n, env_source(var, &v))),
            _ => {
                return Err(OverrideError::BadValue {
                    name: var.to_string(),
                    value: v,
                    expected,
                })
            }
        },
    };
    match flag {
        Some((name, n)) if (1..=max).contains(&n) => Ok(Setting::new(
            n,
            Source::Cli {
                flag: name.to_string(),
                value: n.to_string(),
            },
        )),
        Some((name, n)) => Err(OverrideError::BadValue {
            name: name.to_string(),
            value: n.to_string(),
            expected,
        }),
        None => Ok(from_env.unwrap_or_else(|| Setting::new(default, Source::Default))),
    }
}

impl Config {
    /// The drafting settings as the generation loop takes them.
    pub fn draft_config(&self) -> DraftConfig {
        DraftConfig {
            mode: self.draft.value,
            max: self.draft_max.value,
            ngram: self.draft_ngram.value,
        }
    }

    /// Resolves every setting from `flags` and the variables `env` looks up (pass
    /// `|k| std::env::var(k).ok()` in a binary). Every variable that is set is parsed, also
    /// where a flag or `--quality` decides, so a typo is reported either way.
    pub fn resolve(
        flags: ConfigFlags,
        env: impl Fn(&str) -> Option<String>,
    ) -> Result<Config, OverrideError> {
        let env: &dyn Fn(&str) -> Option<String> = &env;
        let quality = resolve_switch(
            flags.quality.then_some(("--quality", true)),
            QUALITY_ENV,
            false,
            env,
        )?;
        let precision = Setting::new(
            if quality.value {
                Precision::Quality
            } else {
                Precision::Fast
            },
            quality.source,
        );
        let warmup = resolve_switch(
            flags.no_warmup.then_some(("--no-warmup", false)),
            WARMUP_ENV,
            true,
            env,
        )?;
        let tiles_env = match env(PREFILL_TILES_ENV) {
            Some(v) => Some(Setting::new(
                PrefillTiles::parse(v.trim()).ok_or_else(|| OverrideError::BadValue {
                    name: PREFILL_TILES_ENV.to_string(),
                    value: v.clone(),
                    expected: "off, experts or all",
                })?,
                env_source(PREFILL_TILES_ENV, &v),
            )),
            None => None,
        };
        let prefill_tiles = match precision.value {
            // The point of quality is the f32 path: no tiles, whatever the variable says.
            Precision::Quality => Setting::new(PrefillTiles::Off, precision.source.clone()),
            Precision::Fast => tiles_env
                .unwrap_or_else(|| Setting::new(Knobs::fast().prefill_tiles, Source::Default)),
        };
        let draft_env = match env(DRAFT_ENV) {
            Some(v) => Some(Setting::new(
                v.parse::<DraftMode>()
                    .map_err(|_| OverrideError::BadValue {
                        name: DRAFT_ENV.to_string(),
                        value: v.clone(),
                        expected: "off, mtp, lookup or auto",
                    })?,
                env_source(DRAFT_ENV, &v),
            )),
            None => None,
        };
        let draft = match flags.draft {
            Some(m) => Setting::new(
                m,
                Source::Cli {
                    flag: "--draft".into(),
                    value: m.to_string(),
                },
            ),
            None => draft_env.unwrap_or_else(|| Setting::new(DraftMode::Off, Source::Default)),
        };
        let draft_max = bounded(
            flags.draft_max.map(|n| ("--draft-max", n)),
            DRAFT_MAX_ENV,
            DEFAULT_DRAFT_MAX,
            MAX_DRAFT_MAX,
            env,
        )?;
        let draft_ngram = bounded(
            flags.draft_ngram.map(|n| ("--draft-ngram", n)),
            DRAFT_NGRAM_ENV,
            DEFAULT_DRAFT_NGRAM,
            MAX_DRAFT_NGRAM,
            env,
        )?;
        let load = LoadConfig::default();
        let mtp = match env(MTP_ENV) {
            Some(v) if !v.trim().is_empty() => Setting::new(
                Some(std::path::PathBuf::from(v.trim())),
                env_source(MTP_ENV, &v),
            ),
            _ => Setting::new(None, Source::Default),
        };
        Ok(Config {
            mtp,
            draft,
            draft_max,
            draft_ngram,
            precision,
            warmup,
            prefill_tiles,
            expert_readahead: resolve_switch(None, EXPERT_READAHEAD_ENV, true, env)?,
            profile: resolve_switch(None, PROFILE_ENV, false, env)?,
            load_threads: count(LOAD_THREADS_ENV, load.threads, env)?,
            load_staging_mib: count(LOAD_STAGING_ENV, ds4_gpu::backend::DEFAULT_STAGING_MIB, env)?,
        })
    }

    /// `--mtp FILE`: the MTP block's file, over `DS4_MTP`.
    pub fn with_mtp_flag(mut self, path: Option<std::path::PathBuf>) -> Config {
        if let Some(p) = path {
            let value = p.display().to_string();
            self.mtp = Setting::new(
                Some(p),
                Source::Cli {
                    flag: "--mtp".into(),
                    value,
                },
            );
        }
        self
    }

    /// The settings `flags` give without any variable (tests and tools that load engines
    /// of their own; the binaries use [`Self::resolve`]).
    pub fn from_flags(flags: ConfigFlags) -> Config {
        // Only a variable's value can be unreadable, and none is looked up.
        match Config::resolve(flags, |_| None) {
            Ok(c) => c,
            Err(e) => unreachable!("no variable set, yet {e}"),
        }
    }

    /// The GPU backend's settings: the precision's kernels, with the tiles, the profile
    /// and the load pipeline as resolved.
    pub fn knobs(&self) -> Knobs {
        let base = match self.precision.value {
            Precision::Fast => Knobs::fast(),
            Precision::Quality => Knobs::quality(),
        };
        Knobs {
            prefill_tiles: self.prefill_tiles.value,
            profile: self.profile.value,
            load: LoadConfig::with_ring(
                self.load_threads.value,
                self.load_staging_mib.value.saturating_mul(1 << 20),
            ),
            ..base
        }
    }

    /// `(setting, value, source)` for each setting, the GPU kernels the precision selects
    /// included, then the placement overrides.
    pub fn rows(&self, placement: &Overrides) -> Vec<(String, String, String)> {
        let mut rows = Vec::new();
        let mut row = |name: &str, value: String, source: &Source| {
            rows.push((name.to_string(), value, source.to_string()));
        };
        let p = &self.precision;
        let k = self.knobs();
        let on = |b: bool| if b { "on" } else { "off" }.to_string();
        row("precision", p.value.label().to_string(), &p.source);
        row("  int8 decode activations", on(k.activation_q8), &p.source);
        row(
            "  prefill GEMM (cuBLAS)",
            match k.cublas {
                Some(ds4_gpu::cuda::GemmPrecision::Tf32) => "tf32".into(),
                Some(ds4_gpu::cuda::GemmPrecision::F32) => "f32".into(),
                None => "built-in".into(),
            },
            &p.source,
        );
        row(
            "  tensor-core attention",
            on(k.tensor_core_attention),
            &p.source,
        );
        let t = &self.prefill_tiles;
        row("prefill tiles", t.value.name().to_string(), &t.source);
        row("warm-up", on(self.warmup.value), &self.warmup.source);
        let r = &self.expert_readahead;
        row("expert read-ahead", on(r.value), &r.source);
        row(
            "kernel profile",
            on(self.profile.value),
            &self.profile.source,
        );
        let lt = &self.load_threads;
        row("load threads", lt.value.to_string(), &lt.source);
        let ls = &self.load_staging_mib;
        row("load staging MiB", ls.value.to_string(), &ls.source);
        row("draft", self.draft.value.to_string(), &self.draft.source);
        let dm = &self.draft_max;
        row("  draft max", dm.value.to_string(), &dm.source);
        let dn = &self.draft_ngram;
        row("  draft n-gram", dn.value.to_string(), &dn.source);
        let mtp = match &self.mtp.value {
            Some(p) => p.display().to_string(),
            None => "the model file's, if any".to_string(),
        };
        row("  MTP block", mtp, &self.mtp.source);
        let choice = |s: &Setting<ds4_placement::MemChoice>| s.value.to_string();
        let gib = |s: &Setting<Option<u64>>, none: &str| match s.value {
            Some(b) => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
            None => none.to_string(),
        };
        row(
            "weights memory",
            choice(&placement.weights),
            &placement.weights.source,
        );
        row("KV memory", choice(&placement.kv), &placement.kv.source);
        row(
            "scratch memory",
            choice(&placement.scratch),
            &placement.scratch.source,
        );
        row(
            "OS reserve",
            gib(&placement.os_reserve, "policy default"),
            &placement.os_reserve.source,
        );
        row(
            "device memory limit",
            gib(&placement.device_mem_limit, "none"),
            &placement.device_mem_limit.source,
        );
        row(
            "routed experts",
            placement.experts.value.to_string(),
            &placement.experts.source,
        );
        row(
            "expert cache limit",
            gib(&placement.expert_cache, "as large as fits"),
            &placement.expert_cache.source,
        );
        rows
    }

    /// [`Self::rows`] as an aligned table: `setting  value  (source)`.
    pub fn render(&self, placement: &Overrides) -> String {
        let rows = self.rows(placement);
        let w0 = rows.iter().map(|r| r.0.len()).max().unwrap_or(0);
        let w1 = rows.iter().map(|r| r.1.len()).max().unwrap_or(0);
        let mut s = String::new();
        for (name, value, source) in rows {
            let _ = writeln!(s, "{name:<w0$}  {value:<w1$}  ({source})");
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &'static [(&'static str, &'static str)]) -> impl Fn(&str) -> Option<String> {
        move |k| pairs.iter().find(|p| p.0 == k).map(|p| p.1.to_string())
    }

    /// Nothing set: the fast kernels a hand-built GPU backend also defaults to.
    #[test]
    fn defaults_are_the_backends_defaults() {
        let c = Config::default();
        assert_eq!(c.precision.value, Precision::Fast);
        assert!(c.warmup.value && c.expert_readahead.value && !c.profile.value);
        let k = c.knobs();
        assert_eq!(k, Knobs::default());
        assert_eq!(k, ds4_gpu::backend::GpuOptions::default().knobs);
        for (name, _, source) in c.rows(&Overrides::default()) {
            assert_eq!(source, "default", "{name}");
        }
    }

    #[test]
    fn flags_beat_variables_and_say_so() {
        let c = Config::resolve(
            ConfigFlags {
                quality: true,
                no_warmup: true,
                draft: Some(DraftMode::Lookup),
                draft_max: Some(5),
                draft_ngram: None,
            },
            env(&[
                ("DS4_QUALITY", "0"),
                ("DS4_WARMUP", "1"),
                ("DS4_DRAFT", "off"),
                ("DS4_DRAFT_MAX", "2"),
                ("DS4_DRAFT_NGRAM", "4"),
            ]),
        )
        .unwrap();
        assert_eq!(c.precision.value, Precision::Quality);
        assert_eq!(c.precision.source.to_string(), "--quality");
        assert!(!c.warmup.value);
        assert_eq!(c.warmup.source.to_string(), "--no-warmup");
        assert_eq!(c.knobs(), Knobs::quality());
        assert_eq!(c.draft.source.to_string(), "--draft lookup");
        assert_eq!(
            c.draft_config(),
            DraftConfig {
                mode: DraftMode::Lookup,
                max: 5,
                ngram: 4
            }
        );
        assert_eq!(c.draft_ngram.source.to_string(), "DS4_DRAFT_NGRAM=4");
        // Out of range from a flag, and the reserved drafters, are errors.
        let bad = |f: ConfigFlags| Config::resolve(f, |_: &str| None).is_err();
        assert!(bad(ConfigFlags {
            draft_max: Some(0),
            ..ConfigFlags::default()
        }));
        assert!(bad(ConfigFlags {
            draft_ngram: Some(MAX_DRAFT_NGRAM + 1),
            ..ConfigFlags::default()
        }));
    }

    #[test]
    fn variables_set_what_they_name() {
        let c = Config::resolve(
            ConfigFlags::default(),
            env(&[
                ("DS4_QUALITY", "yes"),
                ("DS4_WARMUP", "off"),
                ("DS4_EXPERT_READAHEAD", "0"),
                ("DS4_CUDA_PROFILE", "1"),
                ("DS4_LOAD_THREADS", " 3 "),
                ("DS4_LOAD_STAGING_MIB", "64"),
            ]),
        )
        .unwrap();
        assert_eq!(c.precision.value, Precision::Quality);
        assert_eq!(c.precision.source.to_string(), "DS4_QUALITY=yes");
        assert!(!c.warmup.value && !c.expert_readahead.value && c.profile.value);
        let k = c.knobs();
        assert!(k.profile);
        assert_eq!(k.load, LoadConfig::with_ring(3, 64 << 20));
        let rows = c.render(&Overrides::default());
        assert!(rows.contains("(DS4_LOAD_THREADS= 3 )"), "{rows}");
    }

    /// Quality keeps the f32 panels whatever the tiles variable says (the variable is still
    /// read, so a typo is reported); fast takes it.
    #[test]
    fn tiles_follow_the_variable_only_when_fast() {
        let fast =
            Config::resolve(ConfigFlags::default(), env(&[("DS4_PREFILL_TILES", "all")])).unwrap();
        assert_eq!(fast.prefill_tiles.value, PrefillTiles::All);
        assert_eq!(fast.knobs().prefill_tiles, PrefillTiles::All);
        let q = Config::resolve(
            ConfigFlags {
                quality: true,
                ..ConfigFlags::default()
            },
            env(&[("DS4_PREFILL_TILES", "all")]),
        )
        .unwrap();
        assert_eq!(q.prefill_tiles.value, PrefillTiles::Off);
        assert_eq!(q.prefill_tiles.source.to_string(), "--quality");
        assert!(Config::resolve(
            ConfigFlags {
                quality: true,
                ..ConfigFlags::default()
            },
            env(&[("DS4_PREFILL_TILES", "most")]),
        )
        .is_err());
    }

    #[test]
    fn unreadable_values_are_errors_naming_the_variable() {
        for (var, bad) in [
            ("DS4_QUALITY", "2"),
            ("DS4_WARMUP", "maybe"),
            ("DS4_PREFILL_TILES", "some"),
            ("DS4_EXPERT_READAHEAD", "x"),
            ("DS4_CUDA_PROFILE", "full"),
            ("DS4_LOAD_THREADS", "0"),
            ("DS4_LOAD_STAGING_MIB", "lots"),
            ("DS4_DRAFT", "maybe"),
            ("DS4_DRAFT_MAX", "17"),
            ("DS4_DRAFT_NGRAM", "0"),
        ] {
            let e = Config::resolve(ConfigFlags::default(), move |k: &str| {
                (k == var).then(|| bad.to_string())
            })
            .unwrap_err()
            .to_string();
            assert!(e.contains(var), "{var}: {e}");
        }
    }

    #[test]
    fn the_mtp_drafter_and_its_file_resolve() {
        let env = |k: &str| match k {
            "DS4_DRAFT" => Some("mtp".to_string()),
            "DS4_MTP" => Some("/m/side.gguf".to_string()),
            _ => None,
        };
        let c = Config::resolve(ConfigFlags::default(), env).unwrap();
        assert_eq!(c.draft.value, DraftMode::Mtp);
        assert_eq!(
            c.mtp.value.as_deref(),
            Some(std::path::Path::new("/m/side.gguf"))
        );
        // --mtp over the variable, with its source.
        let c = c.with_mtp_flag(Some("/x.gguf".into()));
        assert_eq!(
            c.mtp.value.as_deref(),
            Some(std::path::Path::new("/x.gguf"))
        );
        assert!(matches!(c.mtp.source, Source::Cli { .. }));
        assert!(Config::default().mtp.value.is_none());
    }
}
