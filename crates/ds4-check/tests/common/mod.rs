//! Helpers shared by the ds4-check test files: machine files and a tiny q2 model.
#![allow(dead_code)]

use std::sync::Arc;

use ds4_convert::SyntheticModel;
use ds4_gguf::GgufFile;
use ds4_model::layout::{placeholder_tokenizer, TypeRecipe};
use ds4_model::HParams;
use ds4_placement::MachineFacts;

pub fn machine(name: &str) -> MachineFacts {
    let path = format!(
        "{}/../ds4-placement/machines/{name}.json",
        env!("CARGO_MANIFEST_DIR")
    );
    MachineFacts::from_json(&std::fs::read_to_string(path).unwrap()).unwrap()
}

/// `ds4_check::parity`'s tiny dims cut to two layers (one sliding, one CSA with the
/// indexer), so the tests that load a model many times stay quick.
pub fn tiny_hparams() -> HParams {
    let n_layer = 2;
    HParams {
        n_layer,
        hash_layer_count: 1,
        swiglu_clamp: vec![10.0; n_layer],
        compress_ratios: vec![0, 4],
        ..ds4_check::parity::tiny_hparams()
    }
}

pub fn model_file(dir: &std::path::Path) -> Arc<GgufFile> {
    model_file_with(dir, TypeRecipe::Q2)
}

/// The tiny model with `recipe`'s types (q2: IQ2_XXS/Q2_K experts; q4: Q4_K experts, which
/// fit the grouped expert GEMV at these widths, IQ2_XXS does not: its 256-element rows are
/// not 16-byte multiples).
pub fn model_file_with(dir: &std::path::Path, recipe: TypeRecipe) -> Arc<GgufFile> {
    model_file_from(dir, tiny_hparams(), recipe)
}

/// A synthetic model of `h` with `recipe`'s types, written to `dir/tiny.gguf`.
pub fn model_file_from(dir: &std::path::Path, h: HParams, recipe: TypeRecipe) -> Arc<GgufFile> {
    let tok = placeholder_tokenizer(h.n_vocab);
    let m = SyntheticModel::from_hparams(h, recipe, 7, &tok).unwrap();
    let (bytes, _) = m
        .write_to(Vec::new(), &mut ds4_convert::NoProgress)
        .unwrap();
    let p = dir.join("tiny.gguf");
    std::fs::write(&p, bytes).unwrap();
    Arc::new(GgufFile::open(&p).unwrap())
}
