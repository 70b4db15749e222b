//! Sentence-embedding models: texts (or token lists) in, one vector each out; over KServe a
//! `text` BYTES input and an `embedding` FP32 output.

use std::sync::{Arc, Mutex};
use std::time::Instant;

use classic::{Data, Tensor};

use super::tensor::{text_input, TEXT_INPUT};
use record::RecordBuilder;
use tracing::Instrument;

use crate::lane::Lane;

use super::{
    Answer, BackendError, Description, EmbedWork, EmbeddingInputs, Embeddings, InferRequest,
    InferResponse, InferenceBackend, Kind, OutputTensor, StartFuture, TensorSpec, Work, WorkKind,
};

/// Embedding models: the vector output over KServe (the input is [`TEXT_INPUT`]).
pub const EMBEDDING_OUTPUT: &str = "embedding";

/// One served embedding model version. Requests run on blocking threads, one batch at a time
/// per model: the embedder's thread pool serves one forward pass at a time.
pub struct EmbeddingBackend {
    name: String,
    embedder: Arc<engine::Embedder>,
    compute: Arc<Mutex<()>>,
    /// Where long texts are tokenized (below the compute's priority, the server's prepare
    /// lane); short ones, and all of them without a lane, beside the compute.
    prepare: Option<Lane>,
}

/// Texts up to this many bytes (a request's together) are tokenized beside the compute; longer
/// ones first on the prepare lane: an embedder reads a few hundred tokens, and a client sending
/// megabytes to be refused as too long would otherwise take a core from the compute.
const INLINE_TEXT_BYTES: usize = 16 * 1024;

impl EmbeddingBackend {
    pub fn new(name: String, embedder: engine::Embedder) -> Self {
        Self {
            name,
            embedder: Arc::new(embedder),
            compute: Arc::new(Mutex::new(())),
            prepare: None,
        }
    }

    /// Tokenizes long texts on `lane` (crate::lane).
    pub fn with_prepare_lane(mut self, lane: Lane) -> Self {
        self.prepare = Some(lane);
        self
    }

    pub fn dimensions(&self) -> usize {
        self.embedder.dimensions()
    }

    pub fn max_seq_len(&self) -> usize {
        self.embedder.max_seq_len()
    }

    /// Tokenizes (texts) and embeds on a blocking thread, one batch at a time per model.
    async fn embed(
        &self,
        inputs: EmbeddingInputs,
        dimensions: Option<usize>,
        record: &mut RecordBuilder,
    ) -> Result<Embeddings, BackendError> {
        if let Some(d) = dimensions {
            let max = self.embedder.dimensions();
            if d > max {
                return Err(BackendError::invalid_param(
                    "dimensions",
                    format!("dimensions must be between 1 and {max} for {}", self.name),
                ));
            }
        }
        let options = engine::EmbedOptions {
            truncate: false,
            dimensions,
        };
        let began = Instant::now();
        let inputs = match (inputs, &self.prepare) {
            (EmbeddingInputs::Texts(texts), Some(lane))
                if texts.iter().map(String::len).sum::<usize>() > INLINE_TEXT_BYTES =>
            {
                let embedder = Arc::clone(&self.embedder);
                let ids = lane
                    .run(move || {
                        texts
                            .iter()
                            .map(|t| embedder.tokenize(t))
                            .collect::<Result<Vec<_>, _>>()
                    })
                    .instrument(tracing::debug_span!("tokenize"))
                    .await
                    .map_err(|e| {
                        BackendError::Failed(format!("tokenization task failed: {e}"))
                    })??;
                EmbeddingInputs::Tokens(ids)
            }
            (inputs, _) => inputs,
        };
        let embedder = Arc::clone(&self.embedder);
        let compute = Arc::clone(&self.compute);
        let result = tokio::task::spawn_blocking(move || {
            let ids = match inputs {
                EmbeddingInputs::Texts(texts) => texts
                    .iter()
                    .map(|t| embedder.tokenize(t))
                    .collect::<Result<Vec<_>, _>>()?,
                EmbeddingInputs::Tokens(ids) => ids,
            };
            let prompt_tokens: usize = ids.iter().map(Vec::len).sum();
            let tokenized = Instant::now();
            let _running = compute.lock().unwrap_or_else(|e| e.into_inner());
            let computing = Instant::now();
            let vectors = embedder.embed_ids(&ids, options)?;
            let times = [began, tokenized, computing, Instant::now()];
            Ok::<_, BackendError>((
                Embeddings {
                    vectors,
                    prompt_tokens,
                },
                times,
            ))
        })
        .instrument(tracing::debug_span!("embed"))
        .await
        .map_err(|e| BackendError::Failed(format!("embedding task failed: {e}")))??;
        let (embeddings, [began, tokenized, computing, done]) = result;
        record.stage("tokenize", began, tokenized);
        // Waiting for the model's one compute slot is the batch wait of an embedder.
        record.stage("batch_wait", tokenized, computing);
        record.stage("compute", computing, done);
        Ok(embeddings)
    }

    /// The KServe form: a `text` BYTES tensor in, an `embedding` `[N, dim]` FP32 tensor out.
    async fn embed_tensors(
        &self,
        request: InferRequest,
        record: &mut RecordBuilder,
    ) -> Result<InferResponse, BackendError> {
        let texts = text_input(&format!("embedding model {:?}", self.name), &request)?;
        let n_texts = texts.len();
        let started = Instant::now();
        let embeddings = self
            .embed(EmbeddingInputs::Texts(texts), None, record)
            .await?;
        record.record.prompt_tokens = embeddings.prompt_tokens;
        record.record.items = n_texts;
        record.record.compute_ms = started.elapsed().as_secs_f64() * 1e3;
        let vectors = embeddings.vectors;
        let dim = vectors.first().map_or(0, Vec::len);
        let n = vectors.len();
        let tensor = Tensor {
            name: EMBEDDING_OUTPUT.into(),
            shape: vec![n, dim],
            data: Data::F32(vectors.into_iter().flatten().collect()),
        };
        if let Some(other) = request.outputs.iter().find(|o| o.name != EMBEDDING_OUTPUT) {
            return Err(BackendError::invalid_param(
                "outputs",
                format!(
                    "model {:?} has no output {:?} (outputs: {EMBEDDING_OUTPUT})",
                    self.name, other.name
                ),
            ));
        }
        let binary = request
            .outputs
            .first()
            .map_or(request.binary_output, |o| o.binary);
        Ok(InferResponse {
            model_name: String::new(),
            model_version: String::new(),
            id: request.id,
            outputs: vec![OutputTensor { tensor, binary }],
            judgements: Vec::new(),
        })
    }
}

impl InferenceBackend for EmbeddingBackend {
    fn kind(&self) -> Kind {
        Kind::Embedding
    }

    fn accepts(&self, work: WorkKind) -> bool {
        matches!(work, WorkKind::Embed | WorkKind::Tensors)
    }

    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        Box::pin(async move {
            match work {
                Work::Embed(EmbedWork { inputs, dimensions }) => {
                    let embeddings = self.embed(inputs, dimensions, record).await?;
                    record.record.prompt_tokens = embeddings.prompt_tokens;
                    Ok(Answer::Embeddings(embeddings))
                }
                Work::Tensors(request) => {
                    Ok(Answer::Tensors(self.embed_tensors(request, record).await?))
                }
                Work::Generate(_) => Err(BackendError::invalid(
                    "an embedding model does not generate text",
                )),
            }
        })
    }

    fn describe(&self) -> Description {
        Description {
            max_context: self.embedder.max_seq_len(),
            platform: "rampart_embedding".into(),
            inputs: vec![TensorSpec {
                name: TEXT_INPUT.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            }],
            outputs: vec![TensorSpec {
                name: EMBEDDING_OUTPUT.into(),
                datatype: "FP32".into(),
                shape: vec![-1, self.embedder.dimensions() as i64],
            }],
            image_input: None,
        }
    }
}
