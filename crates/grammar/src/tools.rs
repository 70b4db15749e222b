//! Tool calling: a request's `tools` and `tool_choice` read and checked; the model family's
//! tool-call syntax ([`ToolFormat`]) found in its chat template; the grammar that holds a
//! call to that syntax and its arguments to the function's parameter schema; and the one
//! parser that reads calls out of the output, whole at the end or piece by piece while it
//! streams, so that a streamed answer and a whole one are the same by construction.
//!
//! Every format lays a call out the same way, fixed by the grammar: an opening (`<tool_call>\n`
//! or a control token), `{"name": "NAME", "arguments": ARGS}` (Llama: `"parameters"`), a
//! closing, and a separator between parallel calls. Arguments are written compactly with one
//! space after `:` and `,`, as the templates print them back in the history.

use std::collections::HashMap;
use std::fmt::Write as _;

use engine::tokenizer::Tokenizer;
use serde_json::{json, Value};

use crate::spec::GrammarSpec;
use crate::GrammarError;

/// Most tools one request may define.
pub const MAX_TOOLS: usize = 128;

/// A family's tool-call syntax.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolFormat {
    /// `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`, one block per call: Qwen 2.5
    /// and 3, Hermes, SmolLM3 (and any ChatML model the operator declares it for).
    Hermes,
    /// `{"name": ..., "parameters": ...}`, one call: Llama 3.1, 3.2 and 3.3.
    Llama3,
    /// `[TOOL_CALLS] [{"name": ..., "arguments": ...}, ...]`: Mistral (v0.3 tokenizer and later).
    Mistral,
    /// `<|tool_call|>[{"name": ..., "arguments": ...}, ...]<|/tool_call|>`: Phi-4-mini.
    Phi4Mini,
    /// `<tool_call>[{"name": ..., "arguments": ...}, ...]</tool_call>`: SmolLM2's function
    /// calling (its template has no tools: the operator declares it, and the tools go into
    /// the system prompt SmolLM2 was tuned with).
    SmolLm2,
}

impl ToolFormat {
    /// Every format, by its configuration name.
    pub const ALL: [ToolFormat; 5] = [
        ToolFormat::Hermes,
        ToolFormat::Llama3,
        ToolFormat::Mistral,
        ToolFormat::Phi4Mini,
        ToolFormat::SmolLm2,
    ];

    /// The configuration name (`[[models]] tool_format`).
    pub fn name(self) -> &'static str {
        match self {
            ToolFormat::Hermes => "hermes",
            ToolFormat::Llama3 => "llama3",
            ToolFormat::Mistral => "mistral",
            ToolFormat::Phi4Mini => "phi4-mini",
            ToolFormat::SmolLm2 => "smollm2",
        }
    }

    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|f| f.name() == name)
    }

    /// The format a chat template writes tool calls in, read off the markers it prints; none
    /// when the template has no tool format (it never reads `tools`).
    pub fn detect(template: &str) -> Option<Self> {
        if !template.contains("tools") {
            return None;
        }
        if template.contains("[TOOL_CALLS]") {
            Some(ToolFormat::Mistral)
        } else if template.contains("<|tool_call|>") || template.contains("<|tool|>") {
            Some(ToolFormat::Phi4Mini)
        } else if template.contains("<tool_call>") {
            Some(ToolFormat::Hermes)
        } else if template.contains("<|python_tag|>")
            || template.contains("\"parameters\": dictionary of argument name")
        {
            Some(ToolFormat::Llama3)
        } else {
            None
        }
    }

    /// Whether the format carries several calls in one answer.
    pub fn parallel(self) -> bool {
        !matches!(self, ToolFormat::Llama3)
    }

    fn layout(self) -> Layout {
        match self {
            ToolFormat::Hermes => Layout {
                open: Marker::None,
                call_open: "<tool_call>\n{\"name\": \"",
                mid: "\", \"arguments\": ",
                call_close: "}\n</tool_call>",
                sep: "\n",
                close: Marker::None,
            },
            ToolFormat::Llama3 => Layout {
                open: Marker::None,
                call_open: "{\"name\": \"",
                mid: "\", \"parameters\": ",
                call_close: "}",
                sep: "; ",
                close: Marker::None,
            },
            ToolFormat::Mistral => Layout {
                open: Marker::Token("[TOOL_CALLS]", " ["),
                call_open: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                call_close: "}",
                sep: ", ",
                close: Marker::Text("]"),
            },
            ToolFormat::Phi4Mini => Layout {
                open: Marker::Token("<|tool_call|>", "["),
                call_open: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                call_close: "}",
                sep: ", ",
                close: Marker::TextToken("]", "<|/tool_call|>"),
            },
            ToolFormat::SmolLm2 => Layout {
                open: Marker::Text("<tool_call>["),
                call_open: "{\"name\": \"",
                mid: "\", \"arguments\": ",
                call_close: "}",
                sep: ", ",
                close: Marker::Text("]</tool_call>"),
            },
        }
    }

    /// The system prompt that shows the tools to a model whose template does not (a declared
    /// format): Qwen's for `hermes`, SmolLM2's own for `smollm2`. `tools` are the template
    /// tools ([`ToolRequest::template_tools`]).
    pub fn system_prompt(self, tools: &[Value]) -> String {
        let lines: Vec<String> = tools.iter().map(py_json).collect();
        match self {
            ToolFormat::SmolLm2 => {
                let functions: Vec<Value> = tools
                    .iter()
                    .map(|t| t.get("function").cloned().unwrap_or(Value::Null))
                    .collect();
                format!(
                    "You are an expert in composing functions. You are given a question and a set of possible functions. \n\
                     Based on the question, you will need to make one or more function/tool calls to achieve the purpose. \n\
                     If none of the functions can be used, point it out and refuse to answer. \n\
                     If the given question lacks the parameters required by the function, also point it out.\n\n\
                     You have access to the following tools:\n<tools>{}</tools>\n\n\
                     The output MUST strictly adhere to the following format, and NO other text MUST be included.\n\
                     The example format is as follows. Please make sure the parameter type is correct. If no function call is needed, please make the tool calls an empty list '[]'.\n\
                     <tool_call>[\n\
                     {{\"name\": \"func_name1\", \"arguments\": {{\"argument1\": \"value1\", \"argument2\": \"value2\"}}}},\n\
                     ... (more tool calls as required)\n\
                     ]</tool_call>",
                    py_json(&Value::Array(functions))
                )
            }
            _ => format!(
                "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n\
                 You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{}\n</tools>\n\n\
                 For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n\
                 <tool_call>\n{{\"name\": <function-name>, \"arguments\": <args-json-object>}}\n</tool_call>",
                lines.join("\n")
            ),
        }
    }

    /// Calls of an earlier assistant turn as the format writes them (declared formats, whose
    /// templates print only text).
    pub fn history_text(self, calls: &[(String, Value)]) -> String {
        let layout = self.layout();
        let body: Vec<String> = calls
            .iter()
            .map(|(name, args)| {
                format!(
                    "{}{}{}{}{}",
                    layout.call_open,
                    name,
                    layout.mid,
                    py_json(args),
                    layout.call_close
                )
            })
            .collect();
        format!(
            "{}{}{}",
            layout.open.text(),
            body.join(layout.sep),
            layout.close.text()
        )
    }

    /// A tool call id as the format's templates accept it: Mistral's are 9 letters and digits,
    /// the others OpenAI's `call_` and 24.
    fn new_id(self) -> String {
        match self {
            ToolFormat::Mistral => random_alnum(9),
            _ => format!("call_{}", random_alnum(24)),
        }
    }
}

/// A call's layout around its name and arguments.
#[derive(Debug, Clone, Copy)]
struct Layout {
    /// Before the first call.
    open: Marker,
    /// Before a call's name.
    call_open: &'static str,
    /// Between the name and the arguments.
    mid: &'static str,
    /// After the arguments.
    call_close: &'static str,
    /// Between two calls.
    sep: &'static str,
    /// After the last call.
    close: Marker,
}

/// Text around the calls, where a control token may stand.
#[derive(Debug, Clone, Copy)]
enum Marker {
    None,
    Text(&'static str),
    /// A control token (the text it shows), then text.
    Token(&'static str, &'static str),
    /// Text, then a control token.
    TextToken(&'static str, &'static str),
}

impl Marker {
    /// The marker's text in the output (control tokens revealed).
    fn text(self) -> String {
        match self {
            Marker::None => String::new(),
            Marker::Text(t) => t.into(),
            Marker::Token(tok, t) => format!("{tok}{t}"),
            Marker::TextToken(t, tok) => format!("{t}{tok}"),
        }
    }

    /// The marker as grammar items: a control token by id when the vocabulary has it as one,
    /// else its text.
    fn lark(self, tokenizer: &Tokenizer) -> String {
        let token = |tok: &str| match special_id(tokenizer, tok) {
            Some(id) => format!("<[{id}]>"),
            None => lit(tok),
        };
        match self {
            Marker::None => String::new(),
            Marker::Text(t) => lit(t),
            Marker::Token(tok, t) => format!("{} {}", token(tok), lit(t)),
            Marker::TextToken(t, tok) => format!("{} {}", lit(t), token(tok)),
        }
    }

    fn token_ids(self, tokenizer: &Tokenizer) -> Vec<u32> {
        match self {
            Marker::Token(tok, _) | Marker::TextToken(_, tok) => {
                special_id(tokenizer, tok).into_iter().collect()
            }
            _ => Vec::new(),
        }
    }
}

/// The id of the control token whose text is `text` (the tokenizer's special-token matcher
/// turns such a text into its one token).
fn special_id(tokenizer: &Tokenizer, text: &str) -> Option<u32> {
    match tokenizer.encode(text, false).ok()?.as_slice() {
        [id] if tokenizer.is_special(*id) => Some(*id),
        _ => None,
    }
}

/// JSON as Python's `json.dumps` writes it (what templates print and models were tuned on).
fn py_json(v: &Value) -> String {
    let mut out = String::new();
    write_py(v, &mut out);
    out
}

fn write_py(v: &Value, out: &mut String) {
    match v {
        Value::Array(items) => {
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                write_py(item, out);
            }
            out.push(']');
        }
        Value::Object(map) => {
            out.push('{');
            for (i, (k, item)) in map.iter().enumerate() {
                if i > 0 {
                    out.push_str(", ");
                }
                out.push_str(&serde_json::to_string(k).unwrap_or_default());
                out.push_str(": ");
                write_py(item, out);
            }
            out.push('}');
        }
        other => out.push_str(&other.to_string()),
    }
}

/// How a request's tools and its history's calls reach a model's template.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolRendering {
    /// The template reads `tools` and each message's `tool_calls` (Qwen, Llama, Mistral).
    Template,
    /// The template reads the tools as JSON text on the system message (Phi-4-mini).
    SystemField,
    /// The template knows no tools: the format's system prompt shows them, and earlier calls
    /// and results become text (a format the operator declared).
    Prompt,
}

impl ToolRendering {
    /// How `template` takes tools.
    pub fn of(template: &str) -> Self {
        if template.contains("message['tools']") || template.contains("message.tools") {
            ToolRendering::SystemField
        } else if template.contains("tools") {
            ToolRendering::Template
        } else {
            ToolRendering::Prompt
        }
    }
}

/// Makes a conversation ready for the template: the tools where it reads them, earlier calls
/// and results in the shape it prints them. Returns the `tools` variable to hand the template
/// (empty unless it reads one).
pub fn prepare_history(
    messages: &mut Vec<engine::ChatMessage>,
    format: ToolFormat,
    rendering: ToolRendering,
    tools: &[Value],
) -> Vec<Value> {
    use engine::ChatMessage;
    if format == ToolFormat::Mistral {
        // Mistral's template refuses ids that are not 9 letters and digits; a client's
        // `call_...` ids map to 9 characters, the same for a call and its result.
        for m in messages.iter_mut() {
            for call in &mut m.tool_calls {
                call.id = nine(&call.id);
            }
            if let Some(id) = m.tool_call_id.as_mut() {
                *id = nine(id);
            }
        }
    }
    match rendering {
        ToolRendering::Template => tools.to_vec(),
        ToolRendering::SystemField => {
            if !tools.is_empty() {
                let functions: Vec<Value> = tools
                    .iter()
                    .map(|t| t.get("function").cloned().unwrap_or(Value::Null))
                    .collect();
                let text = py_json(&Value::Array(functions));
                match messages.first_mut().filter(|m| m.role == "system") {
                    Some(system) => system.tools = Some(text),
                    None => {
                        let mut system = ChatMessage::new("system", "");
                        system.tools = Some(text);
                        messages.insert(0, system);
                    }
                }
            }
            for m in messages.iter_mut() {
                calls_as_text(m, format);
            }
            Vec::new()
        }
        ToolRendering::Prompt => {
            if !tools.is_empty() {
                let prompt = format.system_prompt(tools);
                match messages.first_mut().filter(|m| m.role == "system") {
                    Some(system) => {
                        if !system.content.is_empty() {
                            system.content.push_str("\n\n");
                        }
                        system.content.push_str(&prompt);
                    }
                    None => messages.insert(0, ChatMessage::new("system", &prompt)),
                }
            }
            for m in messages.iter_mut() {
                calls_as_text(m, format);
                if m.role == "tool" && format == ToolFormat::Hermes {
                    m.role = "user".into();
                    m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
                }
            }
            Vec::new()
        }
    }
}

/// An assistant message's calls moved into its text.
fn calls_as_text(m: &mut engine::ChatMessage, format: ToolFormat) {
    if m.tool_calls.is_empty() {
        return;
    }
    let calls: Vec<(String, Value)> = m
        .tool_calls
        .drain(..)
        .map(|c| (c.function.name, c.function.arguments))
        .collect();
    let text = format.history_text(&calls);
    if m.content.is_empty() {
        m.content = text;
    } else {
        m.content = format!("{}\n{text}", m.content);
    }
}

/// A 9-character id of letters and digits standing for `id` (itself when it is one).
fn nine(id: &str) -> String {
    if id.len() == 9 && id.bytes().all(|b| b.is_ascii_alphanumeric()) {
        return id.to_string();
    }
    use sha2::{Digest, Sha256};
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    Sha256::digest(id.as_bytes())
        .iter()
        .take(9)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

/// A Lark string literal.
fn lit(s: &str) -> String {
    serde_json::to_string(s).unwrap_or_else(|_| "\"\"".into())
}

fn random_alnum(n: usize) -> String {
    const ALPHABET: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789";
    let bytes = uuid::Uuid::new_v4().into_bytes();
    let more = uuid::Uuid::new_v4().into_bytes();
    bytes
        .iter()
        .chain(more.iter())
        .take(n)
        .map(|b| ALPHABET[*b as usize % ALPHABET.len()] as char)
        .collect()
}

/// One function a request offers.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolDef {
    pub name: String,
    pub description: Option<String>,
    /// The JSON schema of the arguments (an object schema).
    pub parameters: Value,
    /// OpenAI's `strict`: objects accept no properties they do not declare.
    pub strict: bool,
    /// The tool as the client sent it (what the template prints).
    pub original: Value,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model answers in text (the tools are still shown to it).
    None,
    /// The model chooses text or calls.
    Auto,
    /// The model calls one or more tools.
    Required,
    /// The model calls this function, once.
    Function(String),
}

impl ToolChoice {
    pub fn as_str(&self) -> &str {
        match self {
            ToolChoice::None => "none",
            ToolChoice::Auto => "auto",
            ToolChoice::Required => "required",
            ToolChoice::Function(_) => "function",
        }
    }
}

/// The tool part of a request, checked.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolRequest {
    pub tools: Vec<ToolDef>,
    pub choice: ToolChoice,
    /// `parallel_tool_calls` (default true).
    pub parallel: bool,
}

/// An invalid tool request: the parameter it concerns and what is wrong.
fn invalid(param: &str, message: String) -> (String, GrammarError) {
    (param.to_string(), GrammarError::Invalid(message))
}

impl ToolRequest {
    /// Reads OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`. None when the request
    /// has no tools (a `tool_choice` without tools is refused, as OpenAI does, unless `none`).
    /// The error names the parameter.
    pub fn from_openai(
        tools: Option<&Value>,
        tool_choice: Option<&Value>,
        parallel: Option<bool>,
    ) -> Result<Option<Self>, (String, GrammarError)> {
        let list = match tools {
            None | Some(Value::Null) => {
                return match tool_choice {
                    None | Some(Value::Null) => Ok(None),
                    Some(Value::String(s)) if s == "none" => Ok(None),
                    Some(_) => Err(invalid(
                        "tool_choice",
                        "tool_choice is only allowed when tools are given".into(),
                    )),
                };
            }
            Some(Value::Array(list)) => list,
            Some(_) => return Err(invalid("tools", "tools must be a list".into())),
        };
        if list.is_empty() {
            return Err(invalid(
                "tools",
                "tools must hold at least one tool (leave it out for none)".into(),
            ));
        }
        if list.len() > MAX_TOOLS {
            return Err(invalid(
                "tools",
                format!("at most {MAX_TOOLS} tools, got {}", list.len()),
            ));
        }
        let mut defs = Vec::with_capacity(list.len());
        for (i, tool) in list.iter().enumerate() {
            let def = tool_def(i, tool).map_err(|m| invalid("tools", m))?;
            if defs.iter().any(|d: &ToolDef| d.name == def.name) {
                return Err(invalid(
                    "tools",
                    format!("tools[{i}]: the function name {:?} is used twice", def.name),
                ));
            }
            defs.push(def);
        }
        let choice = match tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => ToolChoice::None,
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(invalid(
                        "tool_choice",
                        format!("tool_choice {other:?} is not one of none, auto, required or {{\"type\": \"function\", \"function\": {{\"name\": ...}}}}"),
                    ))
                }
            },
            Some(Value::Object(o)) => {
                let name = o
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| o.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        invalid(
                            "tool_choice",
                            "a named tool_choice is {\"type\": \"function\", \"function\": {\"name\": ...}}".into(),
                        )
                    })?;
                if !defs.iter().any(|d| d.name == name) {
                    return Err(invalid(
                        "tool_choice",
                        format!("tool_choice names {name:?}, which is not among the tools"),
                    ));
                }
                ToolChoice::Function(name.to_string())
            }
            Some(_) => {
                return Err(invalid(
                    "tool_choice",
                    "tool_choice must be a string or an object".into(),
                ))
            }
        };
        Ok(Some(Self {
            tools: defs,
            choice,
            parallel: parallel.unwrap_or(true),
        }))
    }

    /// The tools as templates read them: `{"type": "function", "function": {...}}`, each as
    /// the client sent it (Hugging Face's `apply_chat_template` and the servers clients know
    /// hand templates the same).
    pub fn template_tools(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.original.clone()).collect()
    }

    /// Size of the definitions in bytes (held to the grammar limit).
    pub fn size(&self) -> usize {
        self.tools
            .iter()
            .map(|t| {
                t.name.len()
                    + t.description.as_ref().map_or(0, String::len)
                    + t.parameters.to_string().len()
            })
            .sum()
    }
}

fn valid_name(name: &str) -> bool {
    !name.is_empty()
        && name.len() <= 64
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'_' || b == b'-')
}

fn tool_def(i: usize, tool: &Value) -> Result<ToolDef, String> {
    let Some(o) = tool.as_object() else {
        return Err(format!("tools[{i}] must be an object"));
    };
    match o.get("type").and_then(Value::as_str) {
        Some("function") => {}
        Some(other) => {
            return Err(format!(
                "tools[{i}].type {other:?} is not supported (function)"
            ))
        }
        None => return Err(format!("tools[{i}].type is missing (function)")),
    }
    let Some(f) = o.get("function").and_then(Value::as_object) else {
        return Err(format!("tools[{i}].function must be an object"));
    };
    let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
    if !valid_name(name) {
        return Err(format!(
            "tools[{i}].function.name must be 1-64 characters of a-z, A-Z, 0-9, _ and -"
        ));
    }
    let description = match f.get("description") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(_) => return Err(format!("tools[{i}].function.description must be a string")),
    };
    let mut parameters = match f.get("parameters") {
        None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
        Some(p @ Value::Object(_)) => p.clone(),
        Some(_) => {
            return Err(format!(
                "tools[{i}].function.parameters must be a JSON schema object"
            ))
        }
    };
    if let Err(e) = jsonschema::meta::validate(&parameters) {
        return Err(format!(
            "tools[{i}].function.parameters is not a valid JSON schema: {e}"
        ));
    }
    match parameters.get("type") {
        None => {
            if let Value::Object(m) = &mut parameters {
                m.insert("type".into(), "object".into());
            }
        }
        Some(Value::String(t)) if t == "object" => {}
        Some(_) => {
            return Err(format!(
                "tools[{i}].function.parameters must describe an object (\"type\": \"object\")"
            ))
        }
    }
    let strict = match f.get("strict") {
        None | Some(Value::Null) => false,
        Some(Value::Bool(b)) => *b,
        Some(_) => return Err(format!("tools[{i}].function.strict must be a boolean")),
    };
    Ok(ToolDef {
        name: name.to_string(),
        description,
        parameters,
        strict,
        original: tool.clone(),
    })
}

/// One request's tool calling against one model: the grammar, the control tokens to show, the
/// parser, the final check.
pub struct ToolSession {
    pub format: ToolFormat,
    pub request: ToolRequest,
    layout: Layout,
    /// The opening of the calls as the output shows it (markers revealed).
    prefix: String,
    close: String,
    reveal: Vec<u32>,
    grammar: Option<GrammarSpec>,
    validators: HashMap<String, jsonschema::Validator>,
}

impl std::fmt::Debug for ToolSession {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolSession")
            .field("format", &self.format)
            .field("choice", &self.request.choice)
            .field("tools", &self.request.tools.len())
            .finish_non_exhaustive()
    }
}

impl ToolSession {
    /// The session of `request` on a model whose calls are in `format`. `text_grammar` is the
    /// request's `response_format` (what a text answer must follow, with `auto` or `none`).
    pub fn new(
        request: ToolRequest,
        format: ToolFormat,
        tokenizer: &Tokenizer,
        text_grammar: Option<&GrammarSpec>,
    ) -> Result<Self, GrammarError> {
        let layout = format.layout();
        let mut validators = HashMap::new();
        for t in &request.tools {
            let schema = effective_parameters(t);
            let v = jsonschema::validator_for(&schema).map_err(|e| {
                GrammarError::Invalid(format!(
                    "the parameters of {:?} are not a valid JSON schema: {e}",
                    t.name
                ))
            })?;
            validators.insert(t.name.clone(), v);
        }
        let prefix = format!("{}{}", layout.open.text(), layout.call_open);
        let mut reveal = layout.open.token_ids(tokenizer);
        reveal.extend(layout.close.token_ids(tokenizer));
        let grammar = build_grammar(&request, format, &prefix, tokenizer, text_grammar)?;
        Ok(Self {
            format,
            layout,
            prefix,
            close: layout.close.text(),
            reveal,
            grammar,
            validators,
            request,
        })
    }

    /// The grammar the output follows; none with `tool_choice: none` and no `response_format`.
    pub fn grammar(&self) -> Option<&GrammarSpec> {
        self.grammar.as_ref()
    }

    /// Control tokens the output must show for the parser to see the calls.
    pub fn reveal(&self) -> &[u32] {
        &self.reveal
    }

    /// A parser for one choice's output.
    pub fn parser(&self) -> ToolParser {
        ToolParser {
            layout: self.layout,
            prefix: self.prefix.clone(),
            close: self.close.clone(),
            text: String::new(),
            mode: if self.request.choice == ToolChoice::None {
                Mode::Content
            } else if self.forced() {
                Mode::Calls
            } else {
                Mode::Undecided
            },
            sent_content: 0,
            started: Vec::new(),
            sent_args: Vec::new(),
        }
    }

    fn forced(&self) -> bool {
        matches!(
            self.request.choice,
            ToolChoice::Required | ToolChoice::Function(_)
        )
    }

    /// A new call id in the format's shape.
    pub fn new_id(&self) -> String {
        self.format.new_id()
    }

    /// The whole output of a choice read at once: its text or its calls, and what is wrong
    /// with them (`by_length`: the output was cut at the token limit).
    pub fn read(&self, text: &str) -> ToolOutput {
        let mut p = self.parser();
        p.text = text.to_string();
        p.decide();
        match p.mode {
            Mode::Content | Mode::Undecided => ToolOutput {
                content: Some(text.to_string()),
                calls: Vec::new(),
                complete: true,
                problem: None,
            },
            Mode::Calls => {
                let scan = scan_calls(&self.layout, &self.prefix, &self.close, text);
                let calls: Vec<(String, String)> = scan
                    .calls
                    .iter()
                    .filter_map(|c| c.name.map(|n| (n.to_string(), c.args.to_string())))
                    .collect();
                let mut problem = scan.error.clone();
                if problem.is_none() && !scan.complete {
                    problem = Some("the output ends inside a tool call".into());
                }
                if problem.is_none() {
                    problem = calls.iter().find_map(|(n, a)| self.check_call(n, a));
                }
                ToolOutput {
                    content: None,
                    calls,
                    complete: scan.complete && scan.error.is_none(),
                    problem,
                }
            }
        }
    }

    /// What is wrong with a call: an unknown function, arguments that are not JSON or break
    /// the function's schema.
    pub fn check_call(&self, name: &str, arguments: &str) -> Option<String> {
        let Some(validator) = self.validators.get(name) else {
            return Some(format!(
                "the call names {name:?}, which is not among the tools"
            ));
        };
        let value: Value = match serde_json::from_str(arguments) {
            Ok(v) => v,
            Err(e) => return Some(format!("the arguments of {name:?} are not JSON: {e}")),
        };
        let problem = validator.iter_errors(&value).next().map(|e| {
            format!(
                "the arguments of {name:?} break its schema: {e} (at {})",
                if e.instance_path().as_str().is_empty() {
                    "the root"
                } else {
                    e.instance_path().as_str()
                }
            )
        });
        problem
    }
}

/// A choice's output as calls or text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolOutput {
    /// The text answer (none when the model called tools).
    pub content: Option<String>,
    /// `(name, arguments)` of each call, in order.
    pub calls: Vec<(String, String)>,
    /// The calls ended as the format ends them.
    pub complete: bool,
    /// What is wrong (an output cut short, arguments that break the schema).
    pub problem: Option<String>,
}

/// The parameters schema a call's arguments are checked and generated against.
fn effective_parameters(t: &ToolDef) -> Value {
    if t.strict {
        GrammarSpec::JsonSchema {
            schema: t.parameters.clone(),
            strict: true,
        }
        .effective_schema()
        .unwrap_or_else(|| t.parameters.clone())
    } else {
        t.parameters.clone()
    }
}

/// The Lark grammar of a request's output.
fn build_grammar(
    request: &ToolRequest,
    format: ToolFormat,
    prefix: &str,
    tokenizer: &Tokenizer,
    text_grammar: Option<&GrammarSpec>,
) -> Result<Option<GrammarSpec>, GrammarError> {
    let text_rule = match text_grammar {
        None => None,
        Some(spec @ (GrammarSpec::JsonSchema { .. } | GrammarSpec::JsonObject)) => {
            let schema = with_layout(spec.effective_schema().unwrap_or(json!({})));
            Some(format!("%json {schema}"))
        }
        Some(other) => {
            return Err(GrammarError::Invalid(format!(
            "a {} response_format cannot be combined with tools (json_schema and json_object can)",
            other.kind()
        )))
        }
    };
    let layout = format.layout();
    let mut g = String::new();
    let functions: Vec<&ToolDef> = match &request.choice {
        ToolChoice::None => {
            return Ok(text_rule.map(|r| GrammarSpec::Lark(format!("start: {r}\n"))));
        }
        ToolChoice::Function(name) => request.tools.iter().filter(|t| &t.name == name).collect(),
        _ => request.tools.iter().collect(),
    };
    let many =
        request.parallel && format.parallel() && !matches!(request.choice, ToolChoice::Function(_));
    match request.choice {
        ToolChoice::Auto => {
            let text = text_rule.unwrap_or_else(|| "TEXT".into());
            let _ = writeln!(g, "start: {text} | calls");
            // A text answer never begins as a call does (the parser tells them apart by it).
            let _ = writeln!(g, "TEXT: /(?s:.+)/ & ~/(?s:{}.*)/", regex_escape(prefix));
        }
        _ => {
            let _ = writeln!(g, "start: calls");
        }
    }
    let open = layout.open.lark(tokenizer);
    let close = layout.close.lark(tokenizer);
    let repeat = if many {
        format!(" ({} call)*", lit(layout.sep))
    } else {
        String::new()
    };
    let _ = writeln!(g, "calls: {open} call{repeat} {close}");
    let alternatives: Vec<String> = (0..functions.len()).map(|i| format!("call_{i}")).collect();
    let _ = writeln!(g, "call: {}", alternatives.join(" | "));
    for (i, t) in functions.iter().enumerate() {
        let schema = with_layout(effective_parameters(t));
        let _ = writeln!(
            g,
            "call_{i}: {} %json {schema} {}",
            lit(&format!("{}{}{}", layout.call_open, t.name, layout.mid)),
            lit(layout.call_close)
        );
    }
    Ok(Some(GrammarSpec::Lark(g)))
}

/// A schema with the JSON layout structured output uses (unless it sets its own).
fn with_layout(mut schema: Value) -> Value {
    if let Value::Object(m) = &mut schema {
        m.entry("x-guidance")
            .or_insert_with(crate::spec::json_layout);
    }
    schema
}

/// `s` as a regex matching it literally (llguidance's regex syntax, which is Rust's).
fn regex_escape(s: &str) -> String {
    regex::escape(s).replace('/', "\\/")
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Not yet known whether the output is text or calls (it is a prefix of the calls'
    /// opening so far).
    Undecided,
    Content,
    Calls,
}

/// What a streamed output adds, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolEvent {
    /// Text of a text answer.
    Content(String),
    /// Call `index` begins: its function's name.
    Call { index: usize, name: String },
    /// More of call `index`'s arguments.
    Arguments { index: usize, fragment: String },
}

/// Reads one choice's output as it streams.
#[derive(Debug)]
pub struct ToolParser {
    layout: Layout,
    prefix: String,
    close: String,
    text: String,
    mode: Mode,
    sent_content: usize,
    started: Vec<bool>,
    sent_args: Vec<usize>,
}

impl ToolParser {
    fn decide(&mut self) {
        if self.mode != Mode::Undecided {
            return;
        }
        let prefix = &self.prefix;
        if self.text.starts_with(prefix.as_str()) {
            self.mode = Mode::Calls;
        } else if !prefix.starts_with(self.text.as_str()) {
            self.mode = Mode::Content;
        }
    }

    /// Takes the next piece of output text; returns what can be sent now.
    pub fn push(&mut self, piece: &str) -> Vec<ToolEvent> {
        self.text.push_str(piece);
        self.decide();
        let mut events = Vec::new();
        match self.mode {
            Mode::Undecided => {}
            Mode::Content => {
                if self.sent_content < self.text.len() {
                    events.push(ToolEvent::Content(
                        self.text[self.sent_content..].to_string(),
                    ));
                    self.sent_content = self.text.len();
                }
            }
            Mode::Calls => {
                let scan = scan_calls(&self.layout, &self.prefix, &self.close, &self.text);
                for (index, call) in scan.calls.iter().enumerate() {
                    let Some(name) = call.name else { break };
                    if self.started.len() <= index {
                        self.started.push(true);
                        self.sent_args.push(0);
                        events.push(ToolEvent::Call {
                            index,
                            name: name.to_string(),
                        });
                    }
                    if call.args.len() > self.sent_args[index] {
                        events.push(ToolEvent::Arguments {
                            index,
                            fragment: call.args[self.sent_args[index]..].to_string(),
                        });
                        self.sent_args[index] = call.args.len();
                    }
                }
            }
        }
        events
    }

    /// The output ended: what is still held back (a text answer that looked like the start
    /// of a call).
    pub fn finish(&mut self) -> Vec<ToolEvent> {
        if self.mode == Mode::Undecided {
            self.mode = Mode::Content;
            return self.push("");
        }
        Vec::new()
    }

    /// Whether the output is calls (known once it began as calls do).
    pub fn calling(&self) -> bool {
        self.mode == Mode::Calls
    }
}

/// One call as far as the output holds it.
#[derive(Debug)]
struct CallScan<'t> {
    /// Known once its closing quote came.
    name: Option<&'t str>,
    /// The arguments' text so far (all of it once they closed).
    args: &'t str,
}

#[derive(Debug)]
struct Scan<'t> {
    calls: Vec<CallScan<'t>>,
    /// The calls' closing came.
    complete: bool,
    /// The output left the format (never under the grammar; a stop string could cut it).
    error: Option<String>,
}

/// Reads the calls out of `text`, which begins with `prefix` or a prefix of it.
fn scan_calls<'t>(layout: &Layout, prefix: &str, close: &str, text: &'t str) -> Scan<'t> {
    let mut scan = Scan {
        calls: Vec::new(),
        complete: false,
        error: None,
    };
    let open = &prefix[..prefix.len() - layout.call_open.len()];
    let mut rest = text;
    // Matches `expected` at the front of `rest`: Some(true) matched, Some(false) `rest` ended
    // inside it, None it differs.
    fn take(rest: &mut &str, expected: &str) -> Option<bool> {
        if rest.starts_with(expected) {
            *rest = &rest[expected.len()..];
            Some(true)
        } else if expected.starts_with(*rest) {
            Some(false)
        } else {
            None
        }
    }
    macro_rules! expect {
        ($what:expr) => {
            match take(&mut rest, $what) {
                Some(true) => {}
                Some(false) => return scan,
                None => {
                    scan.error = Some(format!(
                        "the output leaves the tool-call format where {:?} should be",
                        $what
                    ));
                    return scan;
                }
            }
        };
    }
    expect!(open);
    loop {
        expect!(layout.call_open);
        let Some(end) = rest.find('"') else {
            scan.calls.push(CallScan {
                name: None,
                args: "",
            });
            return scan;
        };
        let name = &rest[..end];
        rest = &rest[end..];
        match take(&mut rest, layout.mid) {
            Some(true) => {}
            Some(false) => {
                scan.calls.push(CallScan {
                    name: None,
                    args: "",
                });
                return scan;
            }
            None => {
                scan.error = Some("the output leaves the tool-call format after a name".into());
                return scan;
            }
        }
        let len = json_value_len(rest);
        let args = &rest[..len.unwrap_or(rest.len())];
        scan.calls.push(CallScan {
            name: Some(name),
            args,
        });
        let Some(len) = len else { return scan };
        rest = &rest[len..];
        expect!(layout.call_close);
        if rest.is_empty() {
            // Without a closing, the calls are whole whenever the output stops here.
            scan.complete = close.is_empty();
            return scan;
        }
        if !close.is_empty() {
            match take(&mut rest, close) {
                Some(true) if rest.is_empty() => {
                    scan.complete = true;
                    return scan;
                }
                Some(true) => {
                    scan.error = Some("the output goes on after the tool calls".into());
                    return scan;
                }
                Some(false) => return scan,
                None => {}
            }
        }
        match take(&mut rest, layout.sep) {
            Some(true) => {}
            Some(false) => return scan,
            None => {
                scan.error = Some("the output leaves the tool-call format between calls".into());
                return scan;
            }
        }
    }
}

/// The length of the JSON value (an object) at the start of `s`; none while it is unfinished.
fn json_value_len(s: &str) -> Option<usize> {
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    for (i, b) in s.bytes().enumerate() {
        if in_string {
            if escaped {
                escaped = false;
            } else if b == b'\\' {
                escaped = true;
            } else if b == b'"' {
                in_string = false;
            }
            continue;
        }
        match b {
            b'"' => in_string = true,
            b'{' | b'[' => depth += 1,
            b'}' | b']' => {
                depth = depth.saturating_sub(1);
                if depth == 0 {
                    return Some(i + 1);
                }
            }
            _ => {}
        }
    }
    None
}

/// The final check of a tool-calling output: its calls read out and each one's arguments
/// validated against its function's schema, independently of the grammar that generated
/// them.
#[derive(Debug)]
pub struct ToolCheck(pub std::sync::Arc<ToolSession>);

impl crate::FinalCheck for ToolCheck {
    fn check(&self, text: &str, by_length: bool) -> crate::Outcome {
        let output = self.0.read(text);
        match output.problem {
            None => crate::Outcome::Valid,
            Some(p) if by_length => crate::Outcome::Incomplete(p),
            Some(p) => crate::Outcome::Invalid(p),
        }
    }

    fn kind(&self) -> &'static str {
        "tools"
    }
}
