//! The tensor inventory: what has to be placed, as the model crate describes it.
//!
//! Kept to (name, bytes, class, layer): the runtime fills it from a GGUF's tensor table,
//! tests fill it from the class totals of the spec. The class is the model crate's.

use serde::{Deserialize, Serialize};
use thiserror::Error;

/// What a tensor is for; the hybrid plan and the report group by this. The model crate's
/// class (decided per tensor name in `ds4_model::names`), so the planner and the model can
/// never disagree on a class.
pub use ds4_model::TensorClass;

/// Which file a tensor comes from.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize, Default,
)]
#[serde(rename_all = "snake_case")]
pub enum WeightSet {
    #[default]
    Main,
    /// The optional MTP sidecar (`--mtp FILE`).
    Mtp,
}

/// One tensor to place.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    pub name: String,
    pub bytes: u64,
    pub class: TensorClass,
    /// Layer index for per-layer tensors, `None` for global ones.
    #[serde(default)]
    pub layer: Option<u32>,
    #[serde(default)]
    pub set: WeightSet,
    /// Number of weights (elements), when known: lets a refusal tell a 4-bit expert
    /// file from a 2-bit one before suggesting a smaller quantization.
    #[serde(default)]
    pub elements: Option<u64>,
}

impl TensorSpec {
    pub fn new(
        name: impl Into<String>,
        bytes: u64,
        class: TensorClass,
        layer: Option<u32>,
    ) -> Self {
        TensorSpec {
            name: name.into(),
            bytes,
            class,
            layer,
            set: WeightSet::Main,
            elements: None,
        }
    }

    pub fn with_elements(mut self, elements: u64) -> Self {
        self.elements = Some(elements);
        self
    }

    pub fn in_set(mut self, set: WeightSet) -> Self {
        self.set = set;
        self
    }
}

/// Inventory problems, each naming the tensor.
#[derive(Debug, Clone, PartialEq, Eq, Error, Serialize)]
pub enum InventoryError {
    #[error("the tensor inventory is empty")]
    Empty,
    #[error("tensor {name:?} appears twice in the {set:?} weight set")]
    Duplicate { name: String, set: WeightSet },
    #[error("tensor {name:?} has 0 bytes")]
    ZeroBytes { name: String },
    #[error("tensor {name:?} has an empty name at index {index}")]
    EmptyName { name: String, index: usize },
    #[error("total tensor bytes overflow 64 bits at tensor {name:?}")]
    Overflow { name: String },
}

/// An ordered list of tensors; the order is the load order the plan keeps.
#[derive(Debug, Clone, PartialEq, Eq, Default, Serialize, Deserialize)]
pub struct TensorInventory {
    pub tensors: Vec<TensorSpec>,
}

impl TensorInventory {
    pub fn new(tensors: Vec<TensorSpec>) -> Self {
        TensorInventory { tensors }
    }

    pub fn push(&mut self, t: TensorSpec) {
        self.tensors.push(t);
    }

    pub fn len(&self) -> usize {
        self.tensors.len()
    }

    pub fn is_empty(&self) -> bool {
        self.tensors.is_empty()
    }

    /// Sum of all tensor bytes (saturating; [`Self::validate`] rejects overflow).
    pub fn total_bytes(&self) -> u64 {
        self.tensors
            .iter()
            .fold(0u64, |a, t| a.saturating_add(t.bytes))
    }

    /// Bytes of one class (saturating).
    pub fn class_bytes(&self, class: TensorClass) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.class == class)
            .fold(0u64, |a, t| a.saturating_add(t.bytes))
    }

    /// Bytes of one weight set (saturating).
    pub fn set_bytes(&self, set: WeightSet) -> u64 {
        self.tensors
            .iter()
            .filter(|t| t.set == set)
            .fold(0u64, |a, t| a.saturating_add(t.bytes))
    }

    /// Average bits per weight of a class, if every tensor of it knows its element count.
    pub fn class_bits_per_weight(&self, class: TensorClass) -> Option<f64> {
        let mut bytes = 0u128;
        let mut elems = 0u128;
        for t in self.tensors.iter().filter(|t| t.class == class) {
            bytes += u128::from(t.bytes);
            elems += u128::from(t.elements.filter(|&e| e > 0)?);
        }
        (elems > 0).then(|| (bytes * 8) as f64 / elems as f64)
    }

    /// Rejects empty inventories, empty names, zero-byte tensors, duplicate names within
    /// a weight set and totals that overflow.
    pub fn validate(&self) -> Result<(), InventoryError> {
        if self.tensors.is_empty() {
            return Err(InventoryError::Empty);
        }
        let mut total: u64 = 0;
        let mut keys: Vec<(WeightSet, &str)> = Vec::with_capacity(self.tensors.len());
        for (i, t) in self.tensors.iter().enumerate() {
            if t.name.is_empty() {
                return Err(InventoryError::EmptyName {
                    name: String::new(),
                    index: i,
                });
            }
            if t.bytes == 0 {
                return Err(InventoryError::ZeroBytes {
                    name: t.name.clone(),
                });
            }
            total = total
                .checked_add(t.bytes)
                .ok_or_else(|| InventoryError::Overflow {
                    name: t.name.clone(),
                })?;
            keys.push((t.set, t.name.as_str()));
        }
        keys.sort_unstable();
        if let Some(w) = keys.windows(2).find(|w| w[0] == w[1]) {
            return Err(InventoryError::Duplicate {
                name: w[0].1.to_string(),
                set: w[0].0,
            });
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(name: &str, bytes: u64, class: TensorClass) -> TensorSpec {
        TensorSpec::new(name, bytes, class, None)
    }

    #[test]
    fn totals_by_class_and_set() {
        let inv = TensorInventory::new(vec![
            t("a", 10, TensorClass::Attention),
            t("e", 100, TensorClass::RoutedExperts),
            t("e", 7, TensorClass::RoutedExperts).in_set(WeightSet::Mtp),
        ]);
        assert_eq!(inv.total_bytes(), 117);
        assert_eq!(inv.class_bytes(TensorClass::RoutedExperts), 107);
        assert_eq!(inv.set_bytes(WeightSet::Mtp), 7);
        assert_eq!(inv.validate(), Ok(()));
    }

    #[test]
    fn bits_per_weight() {
        let inv = TensorInventory::new(vec![
            t("g", 66, TensorClass::RoutedExperts).with_elements(256),
            t("d", 84, TensorClass::RoutedExperts).with_elements(256),
            t("a", 10, TensorClass::Attention),
        ]);
        let b = inv
            .class_bits_per_weight(TensorClass::RoutedExperts)
            .unwrap();
        assert!((b - 150.0 * 8.0 / 512.0).abs() < 1e-9);
        assert_eq!(inv.class_bits_per_weight(TensorClass::Attention), None);
        assert_eq!(inv.class_bits_per_weight(TensorClass::Norms), None);
    }

    #[test]
    fn validation_names_the_tensor() {
        assert_eq!(
            TensorInventory::default().validate(),
            Err(InventoryError::Empty)
        );
        let dup = TensorInventory::new(vec![
            t("x", 1, TensorClass::Norms),
            t("y", 1, TensorClass::Norms),
            t("x", 2, TensorClass::Norms),
        ]);
        assert_eq!(
            dup.validate(),
            Err(InventoryError::Duplicate {
                name: "x".into(),
                set: WeightSet::Main
            })
        );
        let zero = TensorInventory::new(vec![t("z", 0, TensorClass::Norms)]);
        assert_eq!(
            zero.validate(),
            Err(InventoryError::ZeroBytes { name: "z".into() })
        );
        let over = TensorInventory::new(vec![
            t("a", u64::MAX, TensorClass::Norms),
            t("b", 1, TensorClass::Norms),
        ]);
        assert_eq!(
            over.validate(),
            Err(InventoryError::Overflow { name: "b".into() })
        );
        let empty = TensorInventory::new(vec![t("", 1, TensorClass::Norms)]);
        assert!(matches!(
            empty.validate(),
            Err(InventoryError::EmptyName { index: 0, .. })
        ));
    }

    #[test]
    fn hot_classes() {
        assert!(!TensorClass::RoutedExperts.read_whole_every_token());
        assert!(!TensorClass::Embedding.read_whole_every_token());
        for c in TensorClass::ALL {
            if !matches!(c, TensorClass::RoutedExperts | TensorClass::Embedding) {
                assert!(c.read_whole_every_token(), "{c}");
            }
        }
    }
}
