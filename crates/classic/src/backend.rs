//! Backends that run an ONNX graph: tract (pure Rust, always present) and ONNX Runtime (loaded
//! at run time when its library is installed).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use formats::onnx::Dim;
use repo::manifest::TensorSpec;
use tract_onnx::prelude::{
    self as tp, Datum, DatumType, Framework, InferenceFact, InferenceModelExt, IntoTValue, TValue,
    TVec, TypedFact, TypedModel, TypedRunnableModel,
};

use crate::error::ClassicError;
use crate::tensor::{DType, Data, Tensor};

/// One loaded graph. `session` gives a runner for one thread; runners of one backend share the
/// weights.
pub trait Backend: Send + Sync {
    /// `tract` or `onnxruntime`.
    fn name(&self) -> &'static str;
    fn session(&self) -> Result<Box<dyn Session>, ClassicError>;
}

/// Runs the graph; inputs in the graph's input order, outputs in its output order.
pub trait Session: Send {
    fn run(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError>;
}

/// The tract backend. tract optimizes far better for concrete shapes than for symbolic ones
/// (5x on PP-LCNet), so the graph is kept decluttered with its symbols, and an optimized plan is
/// made (and cached) per distinct set of input shapes; the symbolic plan serves when the cache
/// is full.
pub struct TractBackend {
    shared: Arc<TractShared>,
}

struct TractShared {
    /// Decluttered, with the inputs' symbolic dimensions.
    typed: TypedModel,
    /// (input, axis, symbol) of each symbolic input dimension.
    symbols: Vec<(usize, usize, tp::Symbol)>,
    symbolic: Arc<TypedRunnableModel>,
    plans: std::sync::Mutex<HashMap<Vec<Vec<usize>>, Arc<TypedRunnableModel>>>,
    outputs: Vec<String>,
}

/// Concrete plans kept per model.
const PLAN_CACHE: usize = 16;

impl TractBackend {
    /// Loads and declutters `path`. `inputs` are the graph inputs the manifest recorded; unnamed
    /// dimensions become tract symbols.
    pub fn load(
        path: &Path,
        inputs: &[TensorSpec],
        outputs: &[TensorSpec],
    ) -> Result<Self, ClassicError> {
        let fail = |e: tp::TractError| {
            ClassicError::Load(format!("tract cannot load {}: {e:#}", path.display()))
        };
        let mut model = tract_onnx::onnx().model_for_path(path).map_err(fail)?;
        for (i, spec) in inputs.iter().enumerate() {
            let dtype = DType::from_onnx(&spec.dtype)
                .and_then(datum)
                .ok_or_else(|| {
                    ClassicError::Load(format!(
                        "input {:?} has element type {}, which the tract backend does not take",
                        spec.name, spec.dtype
                    ))
                })?;
            let Some(shape) = &spec.shape else { continue };
            // A shape the graph declares fully (numbers and named dimensions) is tract's own
            // fact already; only unnamed dimensions need symbols.
            if shape.iter().all(|d| match d {
                Dim::Fixed(v) => *v > 0,
                Dim::Symbolic(name) => name != "?" && !name.is_empty(),
            }) {
                continue;
            }
            let dims: Vec<tp::TDim> = shape
                .iter()
                .enumerate()
                .map(|(axis, d)| match d {
                    Dim::Fixed(v) if *v > 0 => tp::TDim::Val(*v),
                    // The graph's own name, so facts inside the graph that use it unify.
                    Dim::Symbolic(name) if name != "?" && !name.is_empty() => {
                        model.sym(name).into()
                    }
                    _ => model
                        .sym(&format!("{}_{axis}", sanitize(&spec.name)))
                        .into(),
                })
                .collect();
            let fact: InferenceFact = TypedFact::dt_shape(dtype, dims).into();
            model = model.with_input_fact(i, fact).map_err(fail)?;
        }
        let typed: TypedModel = model
            .into_typed()
            .and_then(|m| m.into_decluttered())
            .map_err(fail)?;
        let mut symbols = Vec::new();
        for (i, outlet) in typed.input_outlets().map_err(fail)?.iter().enumerate() {
            let fact = typed.outlet_fact(*outlet).map_err(fail)?;
            for (axis, d) in fact.shape.iter().enumerate() {
                if let tp::TDim::Sym(s) = d {
                    symbols.push((i, axis, s.clone()));
                }
            }
        }
        let symbolic = tract_onnx::tract_core::plan::SimplePlan::new(
            typed.clone().into_optimized().map_err(fail)?,
        )
        .map_err(fail)?;
        Ok(TractBackend {
            shared: Arc::new(TractShared {
                typed,
                symbols,
                symbolic,
                plans: std::sync::Mutex::new(HashMap::new()),
                outputs: outputs.iter().map(|o| o.name.clone()).collect(),
            }),
        })
    }
}

impl TractShared {
    /// The plan for these input shapes: cached, made now, or the symbolic one.
    fn plan(&self, shapes: &[Vec<usize>]) -> Arc<TypedRunnableModel> {
        if self.symbols.is_empty() {
            return Arc::clone(&self.symbolic);
        }
        let key = shapes.to_vec();
        if let Some(p) = self.plans.lock().ok().and_then(|p| p.get(&key).cloned()) {
            return p;
        }
        let mut subs = HashMap::new();
        for (input, axis, symbol) in &self.symbols {
            match shapes.get(*input).and_then(|s| s.get(*axis)) {
                Some(v) => {
                    subs.insert(symbol.clone(), tp::TDim::Val(*v as i64));
                }
                None => return Arc::clone(&self.symbolic),
            }
        }
        let made = self
            .typed
            .set_symbols(&subs)
            .and_then(|m| m.into_optimized())
            .and_then(tract_onnx::tract_core::plan::SimplePlan::new);
        match made {
            Ok(plan) => {
                if let Ok(mut plans) = self.plans.lock() {
                    if plans.len() < PLAN_CACHE {
                        plans.insert(key, Arc::clone(&plan));
                    }
                }
                plan
            }
            Err(e) => {
                tracing::debug!(error = %e, "no concrete plan for {shapes:?}; using the symbolic one");
                Arc::clone(&self.symbolic)
            }
        }
    }
}

fn datum(dtype: DType) -> Option<DatumType> {
    Some(match dtype {
        DType::Bool => bool::datum_type(),
        DType::U8 => u8::datum_type(),
        DType::U16 => u16::datum_type(),
        DType::U32 => u32::datum_type(),
        DType::U64 => u64::datum_type(),
        DType::I8 => i8::datum_type(),
        DType::I16 => i16::datum_type(),
        DType::I32 => i32::datum_type(),
        DType::I64 => i64::datum_type(),
        DType::F16 => tp::f16::datum_type(),
        DType::F32 => f32::datum_type(),
        DType::F64 => f64::datum_type(),
        DType::Bytes => return None,
    })
}

/// tract symbols are identifiers.
fn sanitize(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
        .collect();
    if s.starts_with(|c: char| c.is_ascii_digit()) {
        format!("d{s}")
    } else {
        s
    }
}

impl Backend for TractBackend {
    fn name(&self) -> &'static str {
        "tract"
    }

    fn session(&self) -> Result<Box<dyn Session>, ClassicError> {
        Ok(Box::new(TractSession {
            shared: Arc::clone(&self.shared),
            states: HashMap::new(),
        }))
    }
}

/// A runner: the shared plans and this thread's states, one per input shape.
struct TractSession {
    shared: Arc<TractShared>,
    states: HashMap<Vec<Vec<usize>>, tp::TypedSimpleState>,
}

fn to_tract(t: Tensor) -> Result<TValue, ClassicError> {
    let fail = |e: tp::TractError| ClassicError::BadInput(format!("input {:?}: {e}", t.name));
    let shape = t.shape.clone();
    let tensor = match &t.data {
        Data::Bool(v) => tp::Tensor::from_shape(&shape, v),
        Data::U8(v) => tp::Tensor::from_shape(&shape, v),
        Data::U16(v) => tp::Tensor::from_shape(&shape, v),
        Data::U32(v) => tp::Tensor::from_shape(&shape, v),
        Data::U64(v) => tp::Tensor::from_shape(&shape, v),
        Data::I8(v) => tp::Tensor::from_shape(&shape, v),
        Data::I16(v) => tp::Tensor::from_shape(&shape, v),
        Data::I32(v) => tp::Tensor::from_shape(&shape, v),
        Data::I64(v) => tp::Tensor::from_shape(&shape, v),
        Data::F16(v) => tp::Tensor::from_shape(&shape, v),
        Data::F32(v) => tp::Tensor::from_shape(&shape, v),
        Data::F64(v) => tp::Tensor::from_shape(&shape, v),
        Data::Bytes(_) => {
            return Err(ClassicError::BadInput(format!(
                "input {:?}: BYTES tensors cannot feed an ONNX graph input",
                t.name
            )))
        }
    }
    .map_err(fail)?;
    Ok(tensor.into_tvalue())
}

fn from_tract(name: &str, t: &tp::Tensor) -> Result<Tensor, ClassicError> {
    let shape = t.shape().to_vec();
    macro_rules! take {
        ($t:ty, $v:ident) => {
            Data::$v(
                t.to_plain_array_view::<$t>()
                    .map_err(|e| ClassicError::Backend(format!("output {name:?}: {e}")))?
                    .iter()
                    .cloned()
                    .collect(),
            )
        };
    }
    let dt = t.datum_type();
    let data = if dt == f32::datum_type() {
        take!(f32, F32)
    } else if dt == i64::datum_type() {
        take!(i64, I64)
    } else if dt == i32::datum_type() {
        take!(i32, I32)
    } else if dt == f64::datum_type() {
        take!(f64, F64)
    } else if dt == tp::f16::datum_type() {
        take!(tp::f16, F16)
    } else if dt == u8::datum_type() {
        take!(u8, U8)
    } else if dt == i8::datum_type() {
        take!(i8, I8)
    } else if dt == bool::datum_type() {
        take!(bool, Bool)
    } else {
        let cast = t
            .cast_to::<f32>()
            .map_err(|e| ClassicError::Backend(format!("output {name:?} of type {dt:?}: {e}")))?;
        Data::F32(
            cast.to_plain_array_view::<f32>()
                .map_err(|e| ClassicError::Backend(format!("output {name:?}: {e}")))?
                .iter()
                .copied()
                .collect(),
        )
    };
    Ok(Tensor {
        name: name.to_string(),
        shape,
        data,
    })
}

impl Session for TractSession {
    fn run(&mut self, inputs: Vec<Tensor>) -> Result<Vec<Tensor>, ClassicError> {
        let shapes: Vec<Vec<usize>> = inputs.iter().map(|t| t.shape.clone()).collect();
        let values: TVec<TValue> = inputs.into_iter().map(to_tract).collect::<Result<_, _>>()?;
        if !self.states.contains_key(&shapes) {
            if self.states.len() >= PLAN_CACHE {
                self.states.clear();
            }
            let state = self
                .shared
                .plan(&shapes)
                .spawn()
                .map_err(|e| ClassicError::Backend(format!("{e:#}")))?;
            self.states.insert(shapes.clone(), state);
        }
        let state = self.states.get_mut(&shapes).expect("inserted above");
        let outputs = state
            .run(values)
            .map_err(|e| ClassicError::Backend(format!("{e:#}")))?;
        outputs
            .iter()
            .enumerate()
            .map(|(i, t)| {
                let name = self
                    .shared
                    .outputs
                    .get(i)
                    .cloned()
                    .unwrap_or_else(|| format!("output_{i}"));
                from_tract(&name, t)
            })
            .collect()
    }
}
