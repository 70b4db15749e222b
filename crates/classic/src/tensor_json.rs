//! A tensor's JSON `data` read straight into its typed buffer, as the KServe v2 REST binding
//! carries it: a flat or nested array (nesting flattened row-major), `BYTES` elements as
//! strings.
//!
//! The reader never builds a `serde_json::Value` (about 32 bytes per element, whatever the
//! element's type): each number goes into a `Vec<f32>`, `Vec<i64>`, ... of the declared type as
//! it is read. The declared shape is checked first (its element count may not overflow, exceed
//! the per-input limit, or decode to more bytes than the request's [`DecodeBudget`] has left)
//! and the buffer is sized from it, never from the data; an element beyond the declared count
//! stops the reading at once. So a request decodes to at most its budget, whatever its shape
//! and its data claim.
//!
//! Not here: the request's envelope (names, parameters, the binary-tensor extension), which is
//! the server's `kserve` module.

use half::f16;
use serde::de::{self, DeserializeSeed, Deserializer, MapAccess, SeqAccess, Visitor};

use crate::error::ClassicError;
use crate::tensor::{element_count, DType, Data, Tensor};

/// The bytes of typed buffers one request may still decode to (all its inputs together).
/// Fixed-size elements count their size; a `BYTES` element counts its `Vec` header and its
/// bytes.
#[derive(Debug, Clone)]
pub struct DecodeBudget {
    limit: usize,
    left: usize,
}

impl DecodeBudget {
    pub fn new(limit: usize) -> Self {
        Self { limit, left: limit }
    }

    /// No limit (tests, trusted callers).
    pub fn unlimited() -> Self {
        Self::new(usize::MAX)
    }

    /// Takes `bytes` for input `name`, or refuses with [`ClassicError::TooLarge`].
    pub fn take(&mut self, name: &str, bytes: usize) -> Result<(), ClassicError> {
        match self.left.checked_sub(bytes) {
            Some(left) => {
                self.left = left;
                Ok(())
            }
            None => Err(ClassicError::TooLarge(format!(
                "input {name:?}: the request's tensors decode to more than {} bytes",
                self.limit
            ))),
        }
    }

    /// Takes what `n` elements of `dtype` need before any is read (for `BYTES`, their headers).
    pub fn take_elements(
        &mut self,
        name: &str,
        dtype: DType,
        n: usize,
    ) -> Result<(), ClassicError> {
        let each = dtype.size().unwrap_or(std::mem::size_of::<Vec<u8>>());
        let bytes = n.checked_mul(each).ok_or_else(|| {
            ClassicError::TooLarge(format!(
                "input {name:?}: {n} {dtype} elements do not fit in memory"
            ))
        })?;
        self.take(name, bytes)
    }
}

/// Reads the JSON text of input `name`'s `data` into a tensor of `dtype` and `shape`. The shape
/// may hold at most `max_elements`; the elements are taken from `budget` before the buffer is
/// made.
pub fn read_data(
    name: &str,
    dtype: DType,
    shape: Vec<usize>,
    text: &str,
    max_elements: usize,
    budget: &mut DecodeBudget,
) -> Result<Tensor, ClassicError> {
    let n = element_count(name, &shape, max_elements)?;
    budget.take_elements(name, dtype, n)?;
    // Each element takes at least one byte and a separator: a short text cannot need a big
    // buffer, whatever the shape claims (the count is still checked against the shape).
    let capacity = n.min(text.len() / 2 + 1);
    macro_rules! read {
        ($v:ident) => {
            Data::$v(read_into(name, dtype, &shape, n, capacity, text, budget)?)
        };
    }
    let data = match dtype {
        DType::Bool => read!(Bool),
        DType::U8 => read!(U8),
        DType::U16 => read!(U16),
        DType::U32 => read!(U32),
        DType::U64 => read!(U64),
        DType::I8 => read!(I8),
        DType::I16 => read!(I16),
        DType::I32 => read!(I32),
        DType::I64 => read!(I64),
        DType::F16 => read!(F16),
        DType::F32 => read!(F32),
        DType::F64 => read!(F64),
        DType::Bytes => read!(Bytes),
    };
    Ok(Tensor {
        name: name.to_string(),
        shape,
        data,
    })
}

fn read_into<T: Element>(
    name: &str,
    dtype: DType,
    shape: &[usize],
    n: usize,
    capacity: usize,
    text: &str,
    budget: &mut DecodeBudget,
) -> Result<Vec<T>, ClassicError> {
    let mut reader = Reader {
        name,
        dtype,
        shape,
        want: n,
        out: Vec::with_capacity(capacity),
        error: None,
        budget,
    };
    let mut de = serde_json::Deserializer::from_str(text);
    let read = Level(&mut reader)
        .deserialize(&mut de)
        .and_then(|()| de.end());
    if let Some(e) = reader.error.take() {
        return Err(e);
    }
    if let Err(e) = read {
        return Err(ClassicError::BadInput(format!(
            "input {name:?}: the data is not valid JSON: {e}"
        )));
    }
    if reader.out.len() != n {
        return Err(ClassicError::BadInput(format!(
            "input {name:?}: shape {shape:?} needs {n} elements, the data holds {}",
            reader.out.len()
        )));
    }
    Ok(reader.out)
}

/// The state of one read: the buffer, the declared count, the first error.
struct Reader<'a, T> {
    name: &'a str,
    dtype: DType,
    shape: &'a [usize],
    want: usize,
    out: Vec<T>,
    /// The precise error, kept here so that the client reads it without serde's position.
    error: Option<ClassicError>,
    budget: &'a mut DecodeBudget,
}

impl<T: Element> Reader<'_, T> {
    fn push<E: de::Error>(&mut self, value: Option<T>, seen: &dyn Fn() -> String) -> Result<(), E> {
        if self.out.len() == self.want {
            return self.fail(ClassicError::BadInput(format!(
                "input {:?}: shape {:?} needs {} elements, the data holds more than {}",
                self.name, self.shape, self.want, self.want
            )));
        }
        let Some(value) = value else {
            return self.wrong(&seen());
        };
        let extra = value.heap_bytes();
        if extra > 0 {
            if let Err(e) = self.budget.take(self.name, extra) {
                return self.fail(e);
            }
        }
        self.out.push(value);
        Ok(())
    }

    fn wrong<E: de::Error>(&mut self, seen: &str) -> Result<(), E> {
        self.fail(ClassicError::BadInput(format!(
            "input {:?}: element {} is {seen}, not a {} value",
            self.name,
            self.out.len(),
            self.dtype
        )))
    }

    fn fail<E: de::Error>(&mut self, e: ClassicError) -> Result<(), E> {
        self.error = Some(e);
        Err(E::custom("tensor data refused"))
    }
}

/// One position of the nested arrays: an array (read level by level) or an element.
struct Level<'r, 'a, T>(&'r mut Reader<'a, T>);

impl<'de, T: Element> DeserializeSeed<'de> for Level<'_, '_, T> {
    type Value = ();

    fn deserialize<D: Deserializer<'de>>(self, deserializer: D) -> Result<(), D::Error> {
        deserializer.deserialize_any(self)
    }
}

/// The text of a refused element, short enough for an error message.
fn shown(s: &str) -> String {
    const MAX: usize = 40;
    match s.char_indices().nth(MAX) {
        Some((cut, _)) => format!("{:?}...", &s[..cut]),
        None => format!("{s:?}"),
    }
}

impl<'de, T: Element> Visitor<'de> for Level<'_, '_, T> {
    type Value = ();

    fn expecting(&self, f: &mut std::fmt::Formatter) -> std::fmt::Result {
        write!(f, "{} elements, possibly in nested arrays", self.0.dtype)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while seq.next_element_seed(Level(&mut *self.0))?.is_some() {}
        Ok(())
    }

    fn visit_bool<E: de::Error>(self, v: bool) -> Result<(), E> {
        self.0.push(T::from_bool(v), &|| v.to_string())
    }

    fn visit_u64<E: de::Error>(self, v: u64) -> Result<(), E> {
        self.0.push(T::from_u64(v), &|| v.to_string())
    }

    fn visit_i64<E: de::Error>(self, v: i64) -> Result<(), E> {
        self.0.push(T::from_i64(v), &|| v.to_string())
    }

    fn visit_f64<E: de::Error>(self, v: f64) -> Result<(), E> {
        self.0.push(T::from_f64(v), &|| v.to_string())
    }

    fn visit_str<E: de::Error>(self, v: &str) -> Result<(), E> {
        self.0.push(T::from_str(v), &|| shown(v))
    }

    fn visit_unit<E: de::Error>(self) -> Result<(), E> {
        self.0.push(None, &|| "null".to_string())
    }

    fn visit_map<A: MapAccess<'de>>(self, _map: A) -> Result<(), A::Error> {
        self.0.wrong("an object")
    }
}

/// An element type the JSON data can hold, and which JSON values it takes (those
/// `Tensor::from_json` takes: integers in range for integer types, any number for floats,
/// `true`/`false` for BOOL, strings for BYTES).
trait Element: Sized {
    fn from_bool(_: bool) -> Option<Self> {
        None
    }
    fn from_u64(_: u64) -> Option<Self> {
        None
    }
    fn from_i64(_: i64) -> Option<Self> {
        None
    }
    fn from_f64(_: f64) -> Option<Self> {
        None
    }
    fn from_str(_: &str) -> Option<Self> {
        None
    }
    /// Bytes the element holds beyond its own size.
    fn heap_bytes(&self) -> usize {
        0
    }
}

impl Element for bool {
    fn from_bool(v: bool) -> Option<Self> {
        Some(v)
    }
}

macro_rules! integers {
    ($($t:ty),*) => {$(
        impl Element for $t {
            fn from_u64(v: u64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
            fn from_i64(v: i64) -> Option<Self> {
                <$t>::try_from(v).ok()
            }
        }
    )*};
}
integers!(u8, u16, u32, u64, i8, i16, i32, i64);

macro_rules! floats {
    ($($t:ty => $from:expr),*) => {$(
        impl Element for $t {
            fn from_u64(v: u64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_i64(v: i64) -> Option<Self> {
                Some($from(v as f64))
            }
            fn from_f64(v: f64) -> Option<Self> {
                Some($from(v))
            }
        }
    )*};
}
floats!(f16 => f16::from_f64, f32 => |x: f64| x as f32, f64 => |x: f64| x);

impl Element for Vec<u8> {
    fn from_str(v: &str) -> Option<Self> {
        Some(v.as_bytes().to_vec())
    }
    fn heap_bytes(&self) -> usize {
        self.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn read(dtype: DType, shape: &[usize], text: &str) -> Result<Tensor, ClassicError> {
        read_data(
            "x",
            dtype,
            shape.to_vec(),
            text,
            1 << 20,
            &mut DecodeBudget::unlimited(),
        )
    }

    fn refused(dtype: DType, shape: &[usize], text: &str) -> String {
        read(dtype, shape, text).unwrap_err().to_string()
    }

    #[test]
    fn nested_and_flat_data_read_the_same() {
        let flat = read(DType::F32, &[2, 2], "[1, 2.5, -3, 4e2]").unwrap();
        let nested = read(DType::F32, &[2, 2], "[[1, 2.5], [-3, 4e2]]").unwrap();
        assert_eq!(flat, nested);
        assert_eq!(flat.as_f32().unwrap(), &[1.0, 2.5, -3.0, 400.0]);
        // Nesting need not match the shape: it is flattened row-major, as before.
        let odd = read(DType::F32, &[2, 2], "[[1], [2.5, [-3]], 4e2]").unwrap();
        assert_eq!(odd, flat);
        // A scalar shape takes a bare element.
        let scalar = read(DType::I64, &[], "7").unwrap();
        assert_eq!(scalar.data, Data::I64(vec![7]));
    }

    #[test]
    fn every_type_reads_into_its_own_buffer() {
        let cases: [(DType, &str, Data); 8] = [
            (DType::Bool, "[true, false]", Data::Bool(vec![true, false])),
            (DType::U8, "[0, 255]", Data::U8(vec![0, 255])),
            (DType::I8, "[-128, 127]", Data::I8(vec![-128, 127])),
            (
                DType::U64,
                "[0, 18446744073709551615]",
                Data::U64(vec![0, u64::MAX]),
            ),
            (
                DType::I64,
                "[-9223372036854775808, 5]",
                Data::I64(vec![i64::MIN, 5]),
            ),
            (
                DType::F16,
                "[1.5, -2]",
                Data::F16(vec![f16::from_f32(1.5), f16::from_f32(-2.0)]),
            ),
            (DType::F64, "[1e-300, 2]", Data::F64(vec![1e-300, 2.0])),
            (
                DType::Bytes,
                r#"["ab", "\u00e9"]"#,
                Data::Bytes(vec![b"ab".to_vec(), "é".as_bytes().to_vec()]),
            ),
        ];
        for (dtype, text, want) in cases {
            let t = read(dtype, &[2], text).unwrap();
            assert_eq!(t.data, want, "{dtype}");
            // The same as the Value-based reader says.
            let value: serde_json::Value = serde_json::from_str(text).unwrap();
            assert_eq!(Tensor::from_json("x", dtype, vec![2], &value).unwrap(), t);
        }
    }

    #[test]
    fn wrong_counts_name_the_input_and_both_counts() {
        let e = refused(DType::F32, &[3], "[1, 2]");
        assert!(
            e.contains("input \"x\": shape [3] needs 3 elements, the data holds 2"),
            "{e}"
        );
        let e = refused(DType::F32, &[1], "[1, 2, 3]");
        assert!(
            e.contains("needs 1 elements, the data holds more than 1"),
            "{e}"
        );
        let e = refused(DType::F32, &[2, 2], "[[1, 2], [3, 4], [5]]");
        assert!(e.contains("more than 4"), "{e}");
        let e = refused(DType::F32, &[0], "[1]");
        assert!(e.contains("more than 0"), "{e}");
        assert_eq!(read(DType::F32, &[0, 5], "[]").unwrap().data.len(), 0);
    }

    #[test]
    fn wrong_types_are_refused_with_the_element() {
        let cases: [(DType, &str, &str); 8] = [
            (DType::U8, "[300]", "element 0 is 300, not a UINT8 value"),
            (DType::U32, "[-1]", "element 0 is -1, not a UINT32 value"),
            (DType::I32, "[1.5]", "element 0 is 1.5, not a INT32 value"),
            (
                DType::F32,
                r#"["a"]"#,
                r#"element 0 is "a", not a FP32 value"#,
            ),
            (DType::Bool, "[1]", "element 0 is 1, not a BOOL value"),
            (DType::Bytes, "[1]", "element 0 is 1, not a BYTES value"),
            (DType::F32, "[null]", "element 0 is null, not a FP32 value"),
            (DType::F32, r#"[{"a": 1}]"#, "element 0 is an object"),
        ];
        for (dtype, text, want) in cases {
            let e = refused(dtype, &[1], text);
            assert!(e.contains(want), "{e} (wanted {want:?})");
            assert!(e.starts_with("input \"x\""), "{e}");
        }
        // A long string is cut in the message.
        let long = format!("[\"{}\"]", "a".repeat(10_000));
        let e = refused(DType::F32, &[1], &long);
        assert!(e.len() < 200, "{e}");
        let e = refused(DType::F32, &[2], "[1, 2");
        assert!(e.contains("not valid JSON"), "{e}");
    }

    #[test]
    fn declared_shapes_are_checked_before_any_buffer() {
        // A product that overflows.
        let e = refused(DType::F32, &[usize::MAX, 2], "[1]");
        assert!(e.contains("holds more than"), "{e}");
        // A product over the per-input limit.
        let e = refused(DType::F32, &[1 << 21], "[1]");
        assert!(e.contains("holds more than 1048576 elements"), "{e}");
        // Within the limit, over the request's budget: refused as too large, before reading.
        let e = read_data(
            "x",
            DType::F64,
            vec![1000],
            "[1]",
            1 << 20,
            &mut DecodeBudget::new(7999),
        )
        .unwrap_err();
        assert!(matches!(e, ClassicError::TooLarge(_)), "{e}");
        assert!(e.to_string().contains("more than 7999 bytes"), "{e}");
        // A huge declared shape with tiny data: the buffer is sized from the text.
        let e = read_data(
            "x",
            DType::F32,
            vec![1 << 19, 2],
            "[1]",
            1 << 20,
            &mut DecodeBudget::unlimited(),
        )
        .unwrap_err();
        assert!(e.to_string().contains("the data holds 1"), "{e}");
    }

    #[test]
    fn the_budget_spans_inputs_and_counts_bytes_elements() {
        let mut budget = DecodeBudget::new(16 + 2 * 24 + 5);
        read_data("a", DType::F32, vec![4], "[1,2,3,4]", 100, &mut budget).unwrap();
        // Two BYTES headers fit; their 6 bytes do not.
        let e = read_data(
            "b",
            DType::Bytes,
            vec![2],
            r#"["abc","def"]"#,
            100,
            &mut budget,
        )
        .unwrap_err();
        assert!(matches!(e, ClassicError::TooLarge(_)), "{e}");
        assert!(e.to_string().starts_with("input \"b\""), "{e}");
    }

    #[test]
    fn deep_nesting_is_an_error_not_a_crash() {
        let deep = format!("{}1{}", "[".repeat(100_000), "]".repeat(100_000));
        let e = refused(DType::F32, &[1], &deep);
        assert!(e.contains("not valid JSON"), "{e}");
    }
}
