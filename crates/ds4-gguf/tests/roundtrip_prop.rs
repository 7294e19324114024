//! Property test: any header we can build survives write → read → write byte-identically,
//! and random corruption of a valid image never panics the reader.

use ds4_gguf::{
    parse, Array, GgmlType, GgufFile, GgufWriter, Header, TensorInfo, Value, ValueType,
};
use proptest::prelude::*;

fn scalar() -> impl Strategy<Value = Value> {
    prop_oneof![
        any::<u8>().prop_map(Value::U8),
        any::<i8>().prop_map(Value::I8),
        any::<u16>().prop_map(Value::U16),
        any::<i16>().prop_map(Value::I16),
        any::<u32>().prop_map(Value::U32),
        any::<i32>().prop_map(Value::I32),
        any::<u32>().prop_map(|b| Value::F32(f32::from_bits(b))),
        any::<bool>().prop_map(Value::Bool),
        ".{0,12}".prop_map(Value::String),
        any::<u64>().prop_map(Value::U64),
        any::<i64>().prop_map(Value::I64),
        any::<u64>().prop_map(|b| Value::F64(f64::from_bits(b))),
    ]
}

fn value() -> impl Strategy<Value = Value> {
    scalar().prop_recursive(3, 24, 6, |inner| {
        (inner, 0usize..6).prop_map(|(v, n)| {
            let ty = v.value_type();
            Value::Array(Array::new(ty, vec![v; n]).expect("one element type"))
        })
    })
}

fn tensor_type() -> impl Strategy<Value = GgmlType> {
    prop::sample::select(GgmlType::KNOWN.to_vec())
}

fn header() -> impl Strategy<Value = Header> {
    let kvs = prop::collection::btree_map("[a-z.]{1,10}", value(), 0..8);
    let tensors = prop::collection::vec(
        (tensor_type(), 1u64..3, prop::collection::vec(1u64..4, 0..3)),
        0..5,
    );
    (kvs, tensors).prop_map(|(kvs, ts)| Header {
        metadata: kvs.into_iter().collect(),
        tensors: ts
            .into_iter()
            .enumerate()
            .map(|(i, (ty, blocks, rest))| {
                let mut dims = vec![ty.block_elems().unwrap() * blocks];
                dims.extend(rest);
                TensorInfo {
                    name: format!("t{i}"),
                    dims,
                    ty,
                    offset: 0,
                }
            })
            .collect(),
    })
}

fn write(h: &Header, seed: u8) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), h.clone()).unwrap();
    let sizes: Vec<u64> = w
        .header()
        .tensors
        .iter()
        .map(|t| t.n_bytes().unwrap())
        .collect();
    for n in sizes {
        let d: Vec<u8> = (0..n).map(|k| (k as u8) ^ seed).collect();
        w.write_tensor(&d).unwrap();
    }
    w.finish().unwrap().0
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 256, ..ProptestConfig::default() })]

    #[test]
    fn round_trip(h in header(), seed in any::<u8>()) {
        let _ = ValueType::U8;
        let img = write(&h, seed);
        let f = GgufFile::from_bytes(img.clone()).unwrap();
        let mut w = GgufWriter::new(Vec::new(), f.header().clone()).unwrap();
        for t in &f.header().tensors {
            w.write_tensor(f.tensor_data(t).unwrap()).unwrap();
        }
        prop_assert_eq!(w.finish().unwrap().0, img);
        prop_assert_eq!(f.header().metadata.len(), h.metadata.len());
    }

    #[test]
    fn corruption_never_panics(h in header(), flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8)) {
        let mut img = write(&h, 1);
        for (i, b) in flips {
            let at = i.index(img.len());
            img[at] = b;
        }
        let _ = parse(&img);
    }
}
