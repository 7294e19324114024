//! Container-level tests: round trips and refusal of malformed files with a named reason.

use ds4_gguf::{
    encode_header, parse, Array, GgmlType, GgufError, GgufFile, GgufWriter, Header, TensorInfo,
    Value, ValueType,
};

fn sample_header() -> Header {
    let mut h = Header::default();
    h.set("general.architecture", Value::String("deepseek4".into()));
    h.set("deepseek4.block_count", Value::U32(2));
    h.set("f", Value::F32(f32::from_bits(0x7fc0_0001)));
    h.set("neg", Value::I64(-5));
    h.set("d", Value::F64(1e-300));
    h.set("b", Value::Bool(true));
    h.set("small", Value::I8(-3));
    h.set("u16", Value::U16(65535));
    h.set("i16", Value::I16(-2));
    h.set("u8", Value::U8(7));
    h.set("u64", Value::U64(u64::MAX));
    h.set("i32", Value::I32(i32::MIN));
    h.set(
        "tokens",
        Value::Array(Array::strings(["a", "ü", "<｜User｜>", ""])),
    );
    h.set(
        "nested",
        Value::Array(
            Array::new(
                ValueType::Array,
                vec![
                    Value::Array(Array::i32s([1, 2, 3])),
                    Value::Array(Array::f32s([])),
                ],
            )
            .unwrap(),
        ),
    );
    h.tensors = vec![
        TensorInfo {
            name: "a".into(),
            dims: vec![32, 3],
            ty: GgmlType::Q8_0,
            offset: 0,
        },
        TensorInfo {
            name: "b".into(),
            dims: vec![3],
            ty: GgmlType::F32,
            offset: 0,
        },
        TensorInfo {
            name: "c".into(),
            dims: vec![256, 2, 2],
            ty: GgmlType::Iq2Xxs,
            offset: 0,
        },
        TensorInfo {
            name: "d".into(),
            dims: vec![5],
            ty: GgmlType::F16,
            offset: 0,
        },
    ];
    h
}

fn write_image(h: &Header, fill: u8) -> Vec<u8> {
    let mut w = GgufWriter::new(Vec::new(), h.clone()).unwrap();
    let sizes: Vec<u64> = w
        .header()
        .tensors
        .iter()
        .map(|t| t.n_bytes().unwrap())
        .collect();
    for (i, n) in sizes.iter().enumerate() {
        let data: Vec<u8> = (0..*n)
            .map(|k| (k as u8).wrapping_mul(31).wrapping_add(fill + i as u8))
            .collect();
        w.write_tensor(&data).unwrap();
    }
    let (bytes, total) = w.finish().unwrap();
    assert_eq!(bytes.len() as u64, total);
    bytes
}

#[test]
fn write_read_write_is_byte_identical() {
    let img = write_image(&sample_header(), 1);
    let f = GgufFile::from_bytes(img.clone()).unwrap();
    assert_eq!(f.layout().alignment, 32);
    assert_eq!(f.layout().data_offset % 32, 0);
    // Rewrite from what was read, copying payloads through zero-copy views.
    let mut w = GgufWriter::new(Vec::new(), f.header().clone()).unwrap();
    for t in &f.header().tensors {
        w.write_tensor(f.tensor_data(t).unwrap()).unwrap();
    }
    let (again, _) = w.finish().unwrap();
    assert_eq!(img, again);
    // Values survive exactly, including a NaN payload.
    let h = f.header();
    match h.get("f") {
        Some(Value::F32(v)) => assert_eq!(v.to_bits(), 0x7fc0_0001),
        other => panic!("{other:?}"),
    }
    assert_eq!(h.get("u64"), Some(&Value::U64(u64::MAX)));
    assert_eq!(h.tensors[2].n_bytes(), Some(4 * 66));
    assert_eq!(f.tensor_bytes("d").unwrap().1.len(), 10);
    assert!(matches!(
        f.tensor_bytes("zz"),
        Err(GgufError::NoSuchTensor { .. })
    ));
}

#[test]
fn custom_alignment_is_honoured() {
    let mut h = sample_header();
    h.set("general.alignment", Value::U32(64));
    let img = write_image(&h, 2);
    let f = GgufFile::from_bytes(img).unwrap();
    assert_eq!(f.layout().alignment, 64);
    assert_eq!(f.layout().data_offset % 64, 0);
    for t in &f.header().tensors {
        assert_eq!(t.offset % 64, 0);
    }
    h.set("general.alignment", Value::U32(0));
    assert!(matches!(
        GgufWriter::new(Vec::new(), h),
        Err(GgufError::BadAlignment { .. })
    ));
}

#[test]
fn open_from_disk_maps_the_file() {
    let img = write_image(&sample_header(), 3);
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    std::fs::write(&p, &img).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.bytes(), &img[..]);
    let missing = GgufFile::open(dir.path().join("none.gguf")).unwrap_err();
    assert!(missing.to_string().contains("none.gguf"), "{missing}");
}

fn err_of(img: &[u8]) -> String {
    parse(img).map(|_| ()).unwrap_err().to_string()
}

#[test]
fn every_truncation_is_refused_without_panic() {
    let img = write_image(&sample_header(), 4);
    let f = GgufFile::from_bytes(img.clone()).unwrap();
    let last = f.header().tensors.last().unwrap();
    // Only the zero padding after the last payload may be cut without losing data.
    let payload_end = (f.layout().data_offset + last.offset + last.n_bytes().unwrap()) as usize;
    for len in 0..img.len() {
        let r = parse(&img[..len]);
        assert_eq!(
            r.is_ok(),
            len >= payload_end,
            "truncated to {len} of {} bytes",
            img.len()
        );
    }
}

#[test]
fn wrong_magic_and_version() {
    let mut img = write_image(&sample_header(), 5);
    img[0] = b'X';
    assert!(err_of(&img).contains("bad magic"));
    let mut img = write_image(&sample_header(), 5);
    img[4] = 2;
    assert!(err_of(&img).contains("version 2"));
    assert!(err_of(b"GGUF").contains("too small"));
}

fn header_bytes(h: &Header) -> Vec<u8> {
    let mut b = encode_header(h).unwrap();
    b.resize(b.len() + 4096, 0);
    b
}

#[test]
fn absurd_counts_are_refused_before_allocating() {
    let mut img = header_bytes(&Header::default());
    img[8..16].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = err_of(&img);
    assert!(e.contains("tensor info count 1152921504606846976"), "{e}");
    let mut img = header_bytes(&Header::default());
    img[16..24].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(err_of(&img).contains("metadata"));
    // A string whose length claims 2^60 bytes.
    let mut h = Header::default();
    h.set("k", Value::String("abc".into()));
    let mut img = header_bytes(&h);
    img[24..32].copy_from_slice(&(1u64 << 60).to_le_bytes());
    assert!(err_of(&img).contains("truncated"));
    // An array claiming 2^60 elements.
    let mut h = Header::default();
    h.set("k", Value::Array(Array::strings(["x"])));
    let mut img = header_bytes(&h);
    let at = 24 + 8 + 1 + 4 + 4;
    img[at..at + 8].copy_from_slice(&(1u64 << 60).to_le_bytes());
    let e = err_of(&img);
    assert!(e.contains("array \"k\" element count"), "{e}");
}

#[test]
fn invalid_utf8_unknown_types_duplicates_and_nesting() {
    let mut h = Header::default();
    h.set("key", Value::String("zz".into()));
    let mut img = header_bytes(&h);
    img[24 + 8] = 0xff;
    assert!(err_of(&img).contains("invalid UTF-8"));

    let mut img = header_bytes(&h);
    img[24 + 8 + 3] = 99; // value type code
    assert!(err_of(&img).contains("unknown metadata value type 99"));

    let mut h = Header::default();
    h.metadata.push(("a".into(), Value::U8(1)));
    h.metadata.push(("a".into(), Value::U8(2)));
    assert!(err_of(&header_bytes(&h)).contains("duplicate metadata key"));

    let mut v = Value::Array(Array::i32s([1]));
    for _ in 0..9 {
        v = Value::Array(Array::new(ValueType::Array, vec![v]).unwrap());
    }
    let mut h = Header::default();
    h.set("deep", v);
    assert!(err_of(&header_bytes(&h)).contains("nested deeper"));

    let mut h = Header::default();
    h.set("b", Value::Bool(true));
    let mut img = header_bytes(&h);
    img[24 + 8 + 1 + 4] = 2;
    assert!(err_of(&img).contains("bool byte is 2"));
}

fn tensor_image(tensors: Vec<TensorInfo>, data_len: usize) -> Vec<u8> {
    let h = Header {
        metadata: vec![],
        tensors,
    };
    let mut b = encode_header(&h).unwrap();
    let pad = b.len().next_multiple_of(32);
    b.resize(pad + data_len, 0);
    b
}

fn ti(name: &str, dims: Vec<u64>, ty: GgmlType, offset: u64) -> TensorInfo {
    TensorInfo {
        name: name.into(),
        dims,
        ty,
        offset,
    }
}

#[test]
fn bad_tensor_tables_are_named() {
    let e = err_of(&tensor_image(
        vec![ti("t", vec![64], GgmlType::F32, 0)],
        100,
    ));
    assert!(e.contains("\"t\"") && e.contains("past the end"), "{e}");
    let e = err_of(&tensor_image(
        vec![ti("t", vec![8], GgmlType::F32, 16)],
        100,
    ));
    assert!(e.contains("not a multiple of the alignment"), "{e}");
    let e = err_of(&tensor_image(
        vec![
            ti("a", vec![16], GgmlType::F32, 0),
            ti("b", vec![8], GgmlType::F32, 32),
        ],
        128,
    ));
    assert!(e.contains("overlap"), "{e}");
    let e = err_of(&tensor_image(
        vec![ti("t", vec![1 << 40, 1 << 40], GgmlType::F32, 0)],
        64,
    ));
    assert!(e.contains("overflows"), "{e}");
    let e = err_of(&tensor_image(
        vec![ti("t", vec![1 << 62], GgmlType::F32, 0)],
        64,
    ));
    assert!(e.contains("overflows") || e.contains("past the end"), "{e}");
    let e = err_of(&tensor_image(
        vec![ti("t", vec![4], GgmlType::Unknown(77), 0)],
        64,
    ));
    assert!(e.contains("unknown ggml type code 77"), "{e}");
    let e = err_of(&tensor_image(
        vec![ti("t", vec![100], GgmlType::Q8_0, 0)],
        4096,
    ));
    assert!(e.contains("block size 32"), "{e}");
    let e = err_of(&tensor_image(
        vec![
            ti("t", vec![4], GgmlType::F32, 0),
            ti("t", vec![4], GgmlType::F32, 32),
        ],
        64,
    ));
    assert!(e.contains("duplicate tensor"), "{e}");
    let mut img = tensor_image(vec![ti("t", vec![4], GgmlType::F32, 0)], 64);
    img[24 + 8 + 1..24 + 8 + 5].copy_from_slice(&9u32.to_le_bytes());
    assert!(err_of(&img).contains("9 dims"));
    let e = err_of(&tensor_image(
        vec![ti("t", vec![4], GgmlType::F32, u64::MAX - 7)],
        64,
    ));
    assert!(e.contains("past the end") || e.contains("alignment"), "{e}");
}

#[test]
fn writer_refuses_wrong_payloads() {
    let h = sample_header();
    let mut w = GgufWriter::new(Vec::new(), h).unwrap();
    assert!(w
        .write_tensor(&[0u8; 3])
        .unwrap_err()
        .to_string()
        .contains("3 bytes supplied"));
    let w = GgufWriter::new(Vec::new(), sample_header()).unwrap();
    assert!(w.finish().unwrap_err().to_string().contains("0 of 4"));
    // An array cannot hold an element of another type than it declares.
    assert!(Array::new(ValueType::U8, vec![Value::U16(1)]).is_none());
}

#[test]
fn dry_run_size_matches_written_size() {
    let h = sample_header();
    let img = write_image(&h, 9);
    assert_eq!(ds4_gguf::file_size(&h).unwrap(), img.len() as u64);
}

#[test]
fn piecewise_writes_equal_whole_tensor_writes() {
    let h = sample_header();
    let whole = write_image(&h, 6);
    let f = GgufFile::from_bytes(whole.clone()).unwrap();
    let mut w = GgufWriter::new(Vec::new(), h).unwrap();
    for t in &f.header().tensors {
        for piece in f.tensor_data(t).unwrap().chunks(7) {
            w.write(piece).unwrap();
        }
    }
    assert_eq!(w.finish().unwrap().0, whole);
    // A piece may not run past the current tensor, and finish names what is missing.
    let mut w = GgufWriter::new(Vec::new(), sample_header()).unwrap();
    w.write(&[0u8; 60]).unwrap();
    assert!(w
        .write(&[0u8; 100])
        .unwrap_err()
        .to_string()
        .contains("it has 102"));
    let e = w.finish().unwrap_err().to_string();
    assert!(e.contains("\"a\" is incomplete (60 of 102 bytes)"), "{e}");
}

#[test]
fn header_only_files_have_a_header_and_no_payloads() {
    let h = sample_header();
    let f = GgufFile::header_only(h.clone()).unwrap();
    assert_eq!(f.header().tensors.len(), h.tensors.len());
    assert_eq!(f.layout().data_offset, f.layout().file_len);
    let name = h.tensors[0].name.clone();
    let e = f.tensor_bytes(&name).unwrap_err().to_string();
    assert!(e.contains(&name) && e.contains("outside"), "{e}");
}

/// A file with MXFP4 tensors (ggml type 39, 17 bytes per 32 values) writes, reads back with
/// its type and size, and its payload dequantizes to the values that were quantized; a
/// row that is not a whole number of blocks is refused by the reader.
#[test]
fn mxfp4_tensors_write_and_read() {
    use ds4_gguf::quant;
    let mut h = Header::default();
    h.set("general.architecture", Value::String("deepseek4".into()));
    const GRID: [f32; 11] = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, -0.5, -1.0, -1.5, -2.0, -3.0];
    let x: Vec<f32> = (0..64 * 3).map(|i| GRID[i % 11]).collect();
    let q = quant::quantize(GgmlType::Mxfp4, &x, None).unwrap();
    h.tensors = vec![
        TensorInfo {
            name: "blk.0.ffn_gate_exps.weight".into(),
            dims: vec![64, 3],
            ty: GgmlType::Mxfp4,
            offset: 0,
        },
        TensorInfo {
            name: "norm".into(),
            dims: vec![3],
            ty: GgmlType::F32,
            offset: 0,
        },
    ];
    let mut w = GgufWriter::new(Vec::new(), h).unwrap();
    w.write_tensor(&q).unwrap();
    w.write_tensor(&[0u8; 12]).unwrap();
    let (img, _) = w.finish().unwrap();
    let f = GgufFile::from_bytes(img).unwrap();
    let t = &f.header().tensors[0];
    assert_eq!(
        (t.ty, t.ty.code(), t.n_bytes()),
        (GgmlType::Mxfp4, 39, Some(6 * 17))
    );
    let data = f.tensor_data(t).unwrap();
    assert_eq!(data, &q[..]);
    let mut y = vec![0f32; x.len()];
    quant::dequantize(GgmlType::Mxfp4, data, &mut y).unwrap();
    assert_eq!(y, x, "these values are on the E2M1 grid");
    // A row of 48 values is not a whole number of MXFP4 blocks: the reader names it.
    let e = err_of(&tensor_image(
        vec![ti("t", vec![48], GgmlType::Mxfp4, 0)],
        4096,
    ));
    assert!(e.contains("block size 32"), "{e}");
}
