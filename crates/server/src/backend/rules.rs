//! Rules models: the rules engine (crate `guard`) behind the seam. A chat or completion gets
//! one JSON answer, `{"category", "confidence", "reasons"}`, each reason a span of the input;
//! over KServe, a `text` BYTES tensor in, `label` and `confidence` out. Deterministic: one
//! "token" per answer, entropy 0.

use classic::{Data, Tensor};

use super::tensor::{record_confidences, text_input, TEXT_INPUT};
use engine::{FinishReason, Finished, Prompt};
use futures_util::stream::{self, StreamExt};
use guard::{Classification, RulesEngine};
use record::RecordBuilder;

use super::{
    Answer, BackendError, Description, GeneratePlan, Generated, Generation, InferRequest,
    InferResponse, InferenceBackend, Kind, OutputTensor, StartFuture, TensorSpec, Token, Work,
    WorkKind,
};

/// KServe names of a rules model's outputs (the input is [`TEXT_INPUT`]).
pub const LABEL_OUTPUT: &str = "label";
pub const CONFIDENCE_OUTPUT: &str = "confidence";

/// One served rules model version.
pub struct RulesBackend {
    name: String,
    engine: RulesEngine,
}

impl RulesBackend {
    pub fn new(name: String, engine: RulesEngine) -> Self {
        Self { name, engine }
    }

    fn generate(
        &self,
        plan: GeneratePlan,
        record: &mut RecordBuilder,
    ) -> Result<Generation, BackendError> {
        let mut events = Vec::new();
        let mut confidences = Vec::new();
        let mut index = 0;
        for prompt in &plan.prompts {
            let text = prompt_text(prompt)?;
            let c = self.engine.classify(&text);
            confidences.push(c.confidence as f32);
            let answer = answer_json(&c);
            for _ in 0..plan.n {
                events.push((
                    index,
                    Generated::Token(Token {
                        text: answer.clone(),
                        entropy: 0.0,
                        logprobs: None,
                    }),
                ));
                events.push((index, Generated::Finished(finished())));
                index += 1;
            }
        }
        record_confidences(record, &confidences);
        Ok(Generation {
            events: stream::iter(events).boxed(),
            choices: index,
            prompt_tokens: 0,
            structured: None,
        })
    }

    fn classify_tensors(
        &self,
        request: InferRequest,
        record: &mut RecordBuilder,
    ) -> Result<InferResponse, BackendError> {
        let texts = text_input(&format!("rules model {:?}", self.name), &request)?;
        let mut labels = Vec::with_capacity(texts.len());
        let mut confidences = Vec::with_capacity(texts.len());
        for text in &texts {
            let c = self.engine.classify(text);
            labels.push(c.label.unwrap_or_default().into_bytes());
            confidences.push(c.confidence as f32);
        }
        record.record.items = texts.len();
        record_confidences(record, &confidences);
        let n = labels.len();
        let all = [
            Tensor {
                name: LABEL_OUTPUT.into(),
                shape: vec![n],
                data: Data::Bytes(labels),
            },
            Tensor {
                name: CONFIDENCE_OUTPUT.into(),
                shape: vec![n],
                data: Data::F32(confidences),
            },
        ];
        let mut outputs = Vec::new();
        if request.outputs.is_empty() {
            outputs.extend(all.into_iter().map(|tensor| OutputTensor {
                tensor,
                binary: request.binary_output,
            }));
        } else {
            for wanted in &request.outputs {
                let tensor = all
                    .iter()
                    .find(|t| t.name == wanted.name)
                    .ok_or_else(|| {
                        BackendError::invalid_param(
                            "outputs",
                            format!(
                                "model {:?} has no output {:?} (outputs: {LABEL_OUTPUT}, {CONFIDENCE_OUTPUT})",
                                self.name, wanted.name
                            ),
                        )
                    })?;
                outputs.push(OutputTensor {
                    tensor: tensor.clone(),
                    binary: wanted.binary,
                });
            }
        }
        Ok(InferResponse {
            model_name: String::new(),
            model_version: String::new(),
            id: request.id,
            outputs,
            judgements: Vec::new(),
        })
    }
}

/// The text a rules model classifies: the prompt, or the last user message of a chat.
fn prompt_text(prompt: &Prompt) -> Result<String, BackendError> {
    match prompt {
        Prompt::Text(text) => Ok(text.clone()),
        Prompt::Chat(messages) => messages
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .ok_or_else(|| {
                BackendError::invalid_param("messages", "a rules model needs a user message")
            }),
        Prompt::Tokens(_) => Err(BackendError::invalid_param(
            "prompt",
            "a rules model classifies text, not token ids",
        )),
    }
}

/// `{"category", "confidence", "reasons": [{"text", "label", "rule", "weight", "start", "end"}]}`.
fn answer_json(c: &Classification) -> String {
    let reasons: Vec<serde_json::Value> = c
        .reasons
        .iter()
        .map(|r| {
            serde_json::json!({
                "text": r.matched,
                "label": r.label,
                "rule": r.rule,
                "weight": r.weight,
                "start": r.start,
                "end": r.end,
            })
        })
        .collect();
    serde_json::json!({
        "category": c.label,
        "confidence": (c.confidence * 1000.0).round() / 1000.0,
        "reasons": reasons,
    })
    .to_string()
}

fn finished() -> Finished {
    Finished {
        reason: FinishReason::Stop,
        prompt_tokens: 0,
        completion_tokens: 1,
        cached_prompt_tokens: 0,
        queue_seconds: 0.0,
        prefill_seconds: 0.0,
        decode_seconds: 0.0,
        trailing_text: String::new(),
    }
}

impl InferenceBackend for RulesBackend {
    fn kind(&self) -> Kind {
        Kind::Rules
    }

    fn accepts(&self, work: WorkKind) -> bool {
        matches!(work, WorkKind::Generate | WorkKind::Tensors)
    }

    fn start<'a>(&'a self, work: Work, record: &'a mut RecordBuilder) -> StartFuture<'a> {
        // Microseconds of work: done on the caller's task.
        let result = match work {
            Work::Generate(plan) => self.generate(*plan, record).map(Answer::Generation),
            Work::Tensors(request) => self.classify_tensors(request, record).map(Answer::Tensors),
            Work::Embed(_) => Err(BackendError::invalid("a rules model does not embed")),
        };
        Box::pin(std::future::ready(result))
    }

    fn describe(&self) -> Description {
        Description {
            max_context: 0,
            platform: "rampart_rules".into(),
            inputs: vec![TensorSpec {
                name: TEXT_INPUT.into(),
                datatype: "BYTES".into(),
                shape: vec![-1],
            }],
            outputs: vec![
                TensorSpec {
                    name: LABEL_OUTPUT.into(),
                    datatype: "BYTES".into(),
                    shape: vec![-1],
                },
                TensorSpec {
                    name: CONFIDENCE_OUTPUT.into(),
                    datatype: "FP32".into(),
                    shape: vec![-1],
                },
            ],
            image_input: None,
        }
    }
}
