//! `ds4 plan`: the placement plan (or refusal) for a model on this or a described machine,
//! computed from the tensor table alone — no GPU is touched, no weight byte is read.

use std::path::{Path, PathBuf};

use crate::error::LoadError;
use ds4_gguf::{GgufFile, Header, TensorInfo};
use ds4_model::catalogue::classify;
use ds4_model::layout::{model_header, mtp_tensor_table, placeholder_tokenizer, TypeRecipe};
use ds4_model::{kv, HParams, ModelSpec, Strictness};
use ds4_placement::{
    plan, resolve_overrides, CliOverrides, DeviceFacts, HostFacts, MachineFacts, Plan, Policy,
    Refusal, Request, TensorInventory, TensorSpec, WeightSet,
};

/// Where the tensor table comes from.
#[derive(Clone)]
pub enum Source {
    File(PathBuf),
    Synthetic(TypeRecipe),
}

#[derive(Clone)]
pub struct PlanArgs {
    pub source: Source,
    /// The MTP block to place with the model (docs/placement.md §10). `None`: none (a
    /// model file's own `mtp.*` tensors are then left out of the plan: nothing loads
    /// them); `Some(None)`: the model's own block — the model file's `mtp.*` tensors, or
    /// the published layout's (`--synthetic`, or a file without a block, to size one);
    /// `Some(Some(f))`: the block in file `f` (ds4's sidecar).
    pub mtp: Option<Option<PathBuf>>,
    pub ctx: u64,
    /// KV states of `ctx` tokens each to budget (the server's `--parallel`; 1 otherwise).
    pub kv_states: u64,
    pub prefill_chunk: u64,
    pub machine: Option<PathBuf>,
    /// The GPU this machine would run on, as probed by the caller
    /// ([`crate::load::probe_device`]), with its description. Used when `machine` is `None`;
    /// `None` plans this machine as CPU-only.
    pub device: Option<(DeviceFacts, String)>,
    pub overrides: CliOverrides,
}

/// A tensor of an MTP block (`mtp.N.*`, docs/gguf.md §4.7).
fn is_mtp(name: &str) -> bool {
    name.starts_with("mtp.")
}

fn layer_of(name: &str) -> Option<u32> {
    name.strip_prefix("blk.")?.split('.').next()?.parse().ok()
}

/// One inventory entry per tensor, in table order.
pub fn inventory_of(tensors: &[TensorInfo], set: WeightSet) -> TensorInventory {
    TensorInventory::new(
        tensors
            .iter()
            .map(|t| {
                let mut s = TensorSpec::new(
                    t.name.clone(),
                    t.n_bytes().unwrap_or(0),
                    classify(&t.name),
                    layer_of(&t.name),
                )
                .in_set(set);
                if let Some(n) = t.n_elements() {
                    s = s.with_elements(n);
                }
                s
            })
            .collect(),
    )
}

fn load_header(path: &Path) -> Result<Header, LoadError> {
    if !path.exists() {
        return Err(LoadError::MissingModel(path.to_path_buf()));
    }
    let f = GgufFile::open(path).map_err(|source| LoadError::Read {
        path: path.to_path_buf(),
        source,
    })?;
    Ok(f.header().clone())
}

pub struct Planned {
    pub description: String,
    pub result: Result<Plan, Refusal>,
    /// When `kv_states` > 1 states do not fit: the most states of the same context that do
    /// (`None`: not even one, or the refusal is not about room). The server's `--parallel`
    /// admission names it, so a user sees what fits instead of only what does not.
    pub fewer_states: Option<u64>,
}

pub fn run(args: &PlanArgs, env: impl Fn(&str) -> Option<String>) -> Result<Planned, LoadError> {
    let (hparams, header, label): (HParams, Header, String) = match &args.source {
        Source::File(p) => {
            let h = load_header(p)?;
            let spec = ModelSpec::from_header(&h, Strictness::Auto).map_err(|source| {
                LoadError::NotAModel {
                    path: p.clone(),
                    source,
                }
            })?;
            (spec.hparams, h, p.display().to_string())
        }
        Source::Synthetic(recipe) => {
            let hp = HParams::flash();
            let h = model_header(&hp, recipe, "synthetic", &placeholder_tokenizer(hp.n_vocab));
            let name = recipe.name().unwrap_or("custom");
            (hp, h, format!("synthetic full-size {name} layout"))
        }
    };
    let (own_mtp, main): (Vec<TensorInfo>, Vec<TensorInfo>) = header
        .tensors
        .iter()
        .cloned()
        .partition(|t| is_mtp(&t.name));
    let mut inventory = inventory_of(&main, WeightSet::Main);
    let mtp_tensors = match &args.mtp {
        None => Vec::new(),
        Some(None) if !own_mtp.is_empty() => own_mtp,
        Some(None) => mtp_tensor_table(&hparams),
        Some(Some(p)) => load_header(p)?
            .tensors
            .into_iter()
            .filter(|t| is_mtp(&t.name))
            .collect(),
    };
    if let Some(Some(p)) = &args.mtp {
        if mtp_tensors.is_empty() {
            return Err(LoadError::NotAnMtpFile(p.clone()));
        }
    }
    for t in inventory_of(&mtp_tensors, WeightSet::Mtp).tensors {
        inventory.push(t);
    }
    if args.ctx == 0 {
        return Err(LoadError::ZeroContext);
    }
    let (host, device, machine_desc): (HostFacts, DeviceFacts, String) = match &args.machine {
        Some(p) => {
            let text = std::fs::read_to_string(p).map_err(|source| LoadError::MachineFile {
                path: p.clone(),
                source,
            })?;
            let m = MachineFacts::from_json(&text).map_err(|e| LoadError::MachineInvalid {
                path: p.clone(),
                source: Box::new(e),
            })?;
            (m.host, m.device, m.description)
        }
        None => {
            let host = ds4_placement::probe::host_facts().map_err(LoadError::HostFacts)?;
            match &args.device {
                Some((facts, desc)) => (host, facts.clone(), format!("this machine ({desc})")),
                None => (host, DeviceFacts::cpu(), "this machine (CPU only)".into()),
            }
        }
    };
    let result = plan_inventory(&hparams, &inventory, &host, &device, args, &env)?;
    let fewer_states = match &result {
        Err(Refusal::DoesNotFit(_)) if args.kv_states > 1 => {
            most_states_fitting(&hparams, &inventory, &host, &device, args, &env)?
        }
        _ => None,
    };
    Ok(Planned {
        fewer_states,
        description: match args.kv_states {
            0 | 1 => format!("{label} on {machine_desc}, ctx {}", args.ctx),
            n => format!(
                "{label} on {machine_desc}, {n} KV states of ctx {}",
                args.ctx
            ),
        },
        result,
    })
}

/// Of `1..args.kv_states` KV states of `args.ctx` tokens, the most that the planner fits on
/// this machine (by bisection: more states only ever need more room); `None` when not even
/// one does. Each count tried is a whole plan, computed from the tensor table alone.
fn most_states_fitting(
    hparams: &HParams,
    inventory: &ds4_placement::TensorInventory,
    host: &HostFacts,
    device: &DeviceFacts,
    args: &PlanArgs,
    env: &impl Fn(&str) -> Option<String>,
) -> Result<Option<u64>, LoadError> {
    let fits = |n: u64| -> Result<bool, LoadError> {
        let tried = PlanArgs {
            kv_states: n,
            ..args.clone()
        };
        Ok(plan_inventory(hparams, inventory, host, device, &tried, env)?.is_ok())
    };
    // `lo` fits (0 trivially), `hi` does not.
    let (mut lo, mut hi) = (0u64, args.kv_states);
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits(mid)? {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok((lo > 0).then_some(lo))
}

/// Plans `inventory` (a model with `hparams`) for `ctx`/`prefill_chunk` on the given
/// machine, with the CLI/environment overrides: the one planning path of `ds4 plan`, the
/// loader and `ds4-bench`.
pub fn plan_inventory(
    hparams: &HParams,
    inventory: &ds4_placement::TensorInventory,
    host: &HostFacts,
    device: &DeviceFacts,
    args: &PlanArgs,
    env: impl Fn(&str) -> Option<String>,
) -> Result<Result<ds4_placement::Plan, ds4_placement::Refusal>, LoadError> {
    let overrides = resolve_overrides(&args.overrides, env).map_err(LoadError::Override)?;
    // N states of `ctx` tokens: N times the per-token growth and the fixed part.
    let states = args.kv_states.max(1);
    let mut request = Request::new(
        args.ctx,
        kv::kv_growth_per_token(hparams).saturating_mul(states),
        kv::scratch_estimate(hparams, args.ctx, args.prefill_chunk),
    );
    request.scratch_bytes_per_4_ctx = kv::scratch_bytes_per_4_ctx(hparams, args.prefill_chunk);
    request.kv_fixed_bytes = kv::kv_fixed_bytes(hparams).saturating_mul(states);
    request.prefill_chunk = args.prefill_chunk;
    request.overrides = overrides;
    // The block's session memory, when its tensors are in the inventory (one block per
    // engine, whatever the number of KV states).
    if inventory.tensors.iter().any(|t| t.set == WeightSet::Mtp) {
        request.mtp_state_bytes =
            ds4_model::mtp::state_bytes(hparams, args.ctx, args.prefill_chunk);
    }
    request.routed_experts = u32::try_from(hparams.n_expert)
        .ok()
        .zip(u32::try_from(hparams.n_expert_used).ok())
        .filter(|&(n, k)| n > 0 && k > 0)
        .map(
            |(per_layer, per_token)| ds4_placement::request::RoutedExperts {
                per_layer,
                per_token,
            },
        );
    let result = plan(host, device, inventory, &request, &Policy::default());
    Ok(result)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_model::names::TensorName;

    /// The planner sees the class the model crate's typed names give every tensor of the
    /// published layouts (main and MTP): no name falls back to a guess.
    #[test]
    fn every_tensor_of_the_layout_has_its_named_class() {
        let hp = HParams::flash();
        for recipe in [TypeRecipe::Q2, TypeRecipe::Q4, TypeRecipe::MXFP4] {
            let h = model_header(&hp, &recipe, "t", &placeholder_tokenizer(hp.n_vocab));
            let mut tables = vec![
                (h.tensors.clone(), WeightSet::Main),
                (mtp_tensor_table(&hp), WeightSet::Mtp),
            ];
            for (table, set) in tables.drain(..) {
                let inv = inventory_of(&table, set);
                assert_eq!(inv.tensors.len(), table.len());
                for (spec, info) in inv.tensors.iter().zip(&table) {
                    let named = TensorName::parse(&info.name)
                        .unwrap_or_else(|| panic!("{} is not a layout name", info.name));
                    assert_eq!(spec.class, named.class(), "{}", info.name);
                    assert_eq!(spec.set, set, "{}", info.name);
                }
            }
        }
    }

    /// `kv_states` budgets that many KV states of the context (the server's `--parallel`).
    #[test]
    fn kv_states_multiply_the_kv_budget() {
        let model = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../../tests/fixtures/demo/ds4-demo.gguf");
        let kv = |kv_states: u64| {
            let args = PlanArgs {
                source: Source::File(model.clone()),
                mtp: None,
                ctx: 4096,
                kv_states,
                prefill_chunk: 64,
                machine: None,
                device: None,
                overrides: CliOverrides::default(),
            };
            let planned = run(&args, |_| None).unwrap();
            let plan = planned.result.unwrap();
            (
                plan.ledger.host.kv + plan.ledger.device.kv,
                planned.description,
            )
        };
        let (one, d1) = kv(1);
        let (three, d3) = kv(3);
        assert!(one > 0);
        assert_eq!(three, 3 * one);
        assert!(
            !d1.contains("KV states") && d3.contains("3 KV states"),
            "{d1} / {d3}"
        );
    }

    /// Several KV states that do not fit are refused with the most that do: that many fit,
    /// one more does not (the server's `--parallel` admission, docs/server.md §9).
    #[test]
    fn a_refused_state_count_names_the_most_that_fit() {
        let machine = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../ds4-placement/machines/h200-128g.json");
        let args = |kv_states: u64| PlanArgs {
            source: Source::Synthetic(TypeRecipe::Q2),
            mtp: None,
            ctx: 1 << 20,
            kv_states,
            prefill_chunk: 2048,
            machine: Some(machine.clone()),
            device: None,
            overrides: CliOverrides::default(),
        };
        let fits = |n: u64| run(&args(n), |_| None).unwrap().result.is_ok();
        let asked = 64;
        let planned = run(&args(asked), |_| None).unwrap();
        assert!(
            planned.result.is_err(),
            "64 states of 1M tokens must not fit"
        );
        let m = planned.fewer_states.expect("some states fit");
        assert!(m >= 1 && m < asked, "{m}");
        assert!(fits(m), "{m} states were said to fit");
        assert!(!fits(m + 1), "{} states fit too", m + 1);
        // One state asked for: nothing to add.
        assert_eq!(run(&args(1), |_| None).unwrap().fewer_states, None);
    }
}
