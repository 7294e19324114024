//! Human-readable load report. Printed before the first byte is copied, by `ds4 plan`
//! and by every loader at start-up, so a user sees where each class goes and why.

use std::fmt::Write;

use crate::bytes::{fmt_bytes, fmt_gib};
use crate::plan::{Plan, PoolLedger};

fn pool_line(out: &mut String, p: &PoolLedger) {
    let _ = writeln!(
        out,
        "  {:<15} {:>12} {:>12} {:>12}{}",
        p.pool.label(),
        fmt_gib(p.used()),
        fmt_gib(p.budget),
        fmt_gib(p.headroom()),
        if p.fits() { "" } else { "  OVER" }
    );
}

impl Plan {
    /// The plan in one line, for a loader's default output: where the weights go (by memory
    /// kind), the session buffers' total and the context. The whole table is
    /// [`Plan::render_text`] (`ds4 plan`, or `-v` at load).
    pub fn summary_line(&self) -> String {
        let mut by_kind: Vec<(crate::MemKind, u64)> = Vec::new();
        for a in &self.arenas {
            match by_kind.iter_mut().find(|(k, _)| *k == a.kind) {
                Some((_, b)) => *b += a.bytes,
                None => by_kind.push((a.kind, a.bytes)),
            }
        }
        let weights = if by_kind.is_empty() {
            "none".to_string()
        } else {
            by_kind
                .iter()
                .map(|(k, b)| format!("{} {}", fmt_gib(*b), k.label()))
                .collect::<Vec<_>>()
                .join(" + ")
        };
        let device = if self.facts.device_kind == crate::device::DeviceKind::CpuOnly {
            "CPU, no GPU".to_string()
        } else {
            format!(
                "{} ({})",
                self.facts.device_name,
                self.facts.device_kind.describe()
            )
        };
        let mut s = format!("placement: {device}, weights {weights}");
        if matches!(
            self.mode,
            crate::plan::WeightsMode::Hybrid | crate::plan::WeightsMode::Streamed
        ) {
            let _ = write!(s, " ({})", self.mode.label());
        }
        if let Some(st) = &self.stream {
            let _ = write!(
                s,
                ", routed experts streamed from the file through a {} cache",
                fmt_gib(st.cache.bytes)
            );
        }
        let buffers: u64 = self
            .buffers
            .iter()
            .filter(|b| b.purpose != crate::plan::BufferPurpose::MtpState)
            .map(|b| b.bytes)
            .sum();
        let _ = write!(s, ", KV and scratch {}, ctx {}", fmt_gib(buffers), self.ctx);
        match &self.mtp {
            Some(m) if m.resident => {
                let _ = write!(
                    s,
                    ", MTP block {} + state {}",
                    fmt_gib(m.weight_bytes),
                    fmt_gib(m.state_bytes)
                );
            }
            Some(_) => s.push_str(", MTP block LEFT OUT (does not fit; drafting by lookup)"),
            None => {}
        }
        if !self.warnings.is_empty() {
            let _ = write!(s, " ({} warnings: -v shows the plan)", self.warnings.len());
        }
        s
    }

    /// The human table: facts, where each class goes, budgets, decisions and warnings.
    pub fn render_text(&self) -> String {
        let f = &self.facts;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "ds4 placement plan: {} ({}), weights: {}, ctx {}",
            f.device_name,
            f.device_kind.describe(),
            self.mode.label(),
            self.ctx
        );
        let mut host = format!(
            "host:   MemTotal {}, MemAvailable {}, CmaFree {}",
            fmt_gib(f.mem_total),
            fmt_gib(f.mem_available),
            fmt_bytes(f.cma_free)
        );
        if let Some(c) = f.cgroup_available {
            let _ = write!(host, ", cgroup allows {}", fmt_gib(c));
        }
        let _ = writeln!(
            s,
            "{host} -> available {}; OS reserve {} ({}) -> usable {}",
            fmt_gib(f.host_available),
            fmt_gib(f.os_reserve),
            f.os_reserve_source,
            fmt_gib(f.host_budget)
        );
        if f.device_kind != crate::device::DeviceKind::CpuOnly {
            let mut dev = format!(
                "device: runtime {} free of {}",
                fmt_gib(f.runtime_free),
                fmt_gib(f.runtime_total)
            );
            if let Some(l) = f.device_limit {
                let _ = write!(
                    dev,
                    ", limited to {} ({})",
                    fmt_gib(l),
                    f.device_limit_source
                );
            }
            if let Some(c) = f.uma_clamp {
                let _ = write!(
                    dev,
                    ", unified-memory clamp: carve-out {} + host available = {}",
                    fmt_gib(f.carve_out_free),
                    fmt_gib(c)
                );
            }
            let _ = writeln!(
                s,
                "{dev} -> free {}; device reserve {} -> budget {}",
                fmt_gib(f.pool_free),
                fmt_bytes(f.device_reserve),
                fmt_gib(f.device_budget)
            );
        }
        if let Some(l) = f.memlock_limit {
            let _ = writeln!(
                s,
                "memlock: RLIMIT_MEMLOCK {} ({})",
                fmt_bytes(l),
                if f.memlock_enforced {
                    "bounds pinned memory on this runtime"
                } else {
                    "the GPU driver pins outside it"
                }
            );
        }
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  {:<18} {:<5} {:<16} {:>7} {:>12}",
            "class", "set", "memory", "tensors", "bytes"
        );
        for r in &self.classes {
            let set = match r.set {
                crate::inventory::WeightSet::Main => "main",
                crate::inventory::WeightSet::Mtp => "mtp",
            };
            let _ = writeln!(
                s,
                "  {:<18} {:<5} {:<16} {:>7} {:>12}",
                r.class.label(),
                set,
                r.kind.label(),
                r.tensors,
                fmt_bytes(r.bytes)
            );
        }
        for b in &self.buffers {
            let _ = writeln!(
                s,
                "  {:<18} {:<5} {:<16} {:>7} {:>12}",
                b.name,
                "",
                b.kind.label(),
                "-",
                fmt_bytes(b.bytes)
            );
        }
        let total = self.weights_bytes() + self.buffers.iter().map(|b| b.bytes).sum::<u64>();
        let _ = writeln!(
            s,
            "  {:<18} {:<5} {:<16} {:>7} {:>12}",
            "total",
            "",
            "",
            "",
            fmt_gib(total)
        );
        let _ = writeln!(s);
        let _ = writeln!(
            s,
            "  {:<15} {:>12} {:>12} {:>12}",
            "budget", "planned", "limit", "headroom"
        );
        for p in self.ledger.pools() {
            pool_line(&mut s, p);
        }
        let dedicated = self.arenas.iter().filter(|a| a.dedicated).count();
        let _ = writeln!(
            s,
            "arenas: {} ({} dedicated exact-size, {} shared), stranded {} (alignment padding); load: {}",
            self.arenas.len(),
            dedicated,
            self.arenas.len() - dedicated,
            fmt_bytes(self.stranded_bytes()),
            self.load.text()
        );
        let _ = writeln!(s, "decisions:");
        for d in &self.decisions {
            let kind = d
                .kind
                .map_or("dropped".to_string(), |k| k.label().to_string());
            let _ = writeln!(
                s,
                "  {} -> {} ({}): {}",
                d.subject,
                kind,
                fmt_gib(d.bytes),
                d.rule.text()
            );
            if !d.detail.is_empty() {
                let _ = writeln!(s, "      {}", d.detail);
            }
            for a in &d.rejected {
                let _ = writeln!(s, "      rejected {}: {}", a.option, a.reason);
            }
            let _ = writeln!(s, "      setting: {}; change with {}", d.source, d.change);
        }
        if let Some(st) = &self.stream {
            let _ = writeln!(s, "streamed routed experts:");
            let _ = writeln!(
                s,
                "  {} in {} tensors stay in the model file: {} units (layer, expert) of up to {}; {} of {} experts per layer per token = {} per token",
                fmt_gib(st.all_bytes),
                st.tensors.len(),
                st.units,
                fmt_bytes(st.slot_bytes),
                st.experts_per_token,
                st.experts_per_layer,
                fmt_gib(st.per_token_bytes)
            );
            let tier = st.host_tier.as_ref().map_or(String::new(), |t| {
                format!(
                    " + host tier {} in {} ({} units)",
                    fmt_gib(t.bytes),
                    t.kind.label(),
                    st.host_tier_slots
                )
            });
            let _ = writeln!(
                s,
                "  cache {} in {} ({} units){tier}; minimum accepted {}",
                fmt_gib(st.cache.bytes),
                st.cache.kind.label(),
                st.cache_slots,
                fmt_gib(st.min_cache_bytes)
            );
            let rate = if st.read_rate_measured {
                "measured"
            } else {
                "ASSUMED (policy default; no measured rate given)"
            };
            let _ = writeln!(
                s,
                "  estimate: hit rate {:.1}% ASSUMED (uniform routing: cached share of all units; skewed routing hits more), disk {:.2} GB/s {rate}",
                st.assumed_hit_rate * 100.0,
                st.read_bytes_per_s as f64 / 1e9
            );
            match st.predicted_tokens_per_s {
                Some(t) => {
                    let _ = writeln!(
                        s,
                        "  -> {} read from disk per token, at most {t:.2} tok/s from the disk alone (compute not included)",
                        fmt_gib(st.disk_bytes_per_token)
                    );
                }
                None => {
                    let _ = writeln!(s, "  -> every unit is cached: no disk reads per token");
                }
            }
        }
        if let Some(m) = &self.mtp {
            if m.resident {
                let _ = writeln!(
                    s,
                    "MTP block: {} of weights (the rows of set mtp) + {} of state (MTP state), resident",
                    fmt_gib(m.weight_bytes),
                    fmt_gib(m.state_bytes)
                );
            } else {
                let _ = writeln!(
                    s,
                    "MTP block: LEFT OUT ({} of weights + {} of state): {}; --draft mtp|auto draft by prompt lookup",
                    fmt_gib(m.weight_bytes),
                    fmt_gib(m.state_bytes),
                    m.reason
                );
            }
        }
        if !self.warnings.is_empty() {
            let _ = writeln!(s, "warnings:");
            for w in &self.warnings {
                let _ = writeln!(s, "  - {w}");
            }
        }
        s
    }
}
