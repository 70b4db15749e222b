//! Chat templates: the Jinja templates models ship (`tokenizer.chat_template`), rendered with
//! minijinja plus the helpers Hugging Face templates call (`raise_exception`, `strftime_now`,
//! Python string methods such as `.strip()` and `.startswith()`, and a `tojson` that writes what
//! Python's `json.dumps` writes, as Hugging Face's does). Tools and tool calls reach the
//! template in the shape Hugging Face templates read: `tools` as a list of
//! `{"type": "function", "function": {...}}`, an assistant message's `tool_calls` as
//! `{"id", "type", "function": {"name", "arguments"}}` with the arguments an object.

use minijinja::value::{Kwargs, ValueKind};
use minijinja::{context, Environment, Error, ErrorKind, Value};
use serde::{Deserialize, Serialize};

use crate::error::EngineError;

/// One message of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant` (or `tool`).
    pub role: String,
    pub content: String,
    /// An assistant message's calls of tools.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A tool message: the call it answers.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    /// A tool message: the function that answered (some templates print it).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
    /// A system message's tools as JSON text, for templates that read them there (Phi-4-mini).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tools: Option<String>,
}

impl ChatMessage {
    pub fn new(role: &str, content: &str) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
            name: None,
            tools: None,
        }
    }
}

/// One call of a tool, as an assistant message in the history holds it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ToolCall {
    pub id: String,
    #[serde(rename = "type")]
    pub kind: String,
    pub function: FunctionCall,
}

/// The function a [`ToolCall`] calls, with its arguments as a JSON value (an object).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct FunctionCall {
    pub name: String,
    pub arguments: serde_json::Value,
}

/// A compiled chat template.
pub struct ChatTemplate {
    env: Environment<'static>,
    bos_token: String,
    eos_token: String,
    source: String,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate").finish_non_exhaustive()
    }
}

fn raise_exception(message: String) -> Result<String, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// Days since 1970-01-01 → (year, month 1..=12, day 1..=31), proleptic Gregorian.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let month = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let year = yoe + era * 400 + i64::from(month <= 2);
    (year, month, day)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
    "Monday",
    "Tuesday",
    "Wednesday",
];

/// `strftime` for a UTC time in seconds since the epoch, covering the directives templates use.
pub fn strftime(format: &str, unix_seconds: i64) -> String {
    let days = unix_seconds.div_euclid(86_400);
    let secs = unix_seconds.rem_euclid(86_400);
    let (year, month, day) = civil_from_days(days);
    let (hour, minute, second) = (secs / 3600, secs / 60 % 60, secs % 60);
    let weekday = WEEKDAYS[days.rem_euclid(7) as usize];
    let month_name = MONTHS[(month - 1) as usize];
    let mut out = String::new();
    let mut chars = format.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        match chars.next() {
            Some('Y') => out.push_str(&year.to_string()),
            Some('y') => out.push_str(&format!("{:02}", year.rem_euclid(100))),
            Some('m') => out.push_str(&format!("{month:02}")),
            Some('d') => out.push_str(&format!("{day:02}")),
            Some('e') => out.push_str(&format!("{day:2}")),
            Some('B') => out.push_str(month_name),
            Some('b') | Some('h') => out.push_str(&month_name[..3]),
            Some('A') => out.push_str(weekday),
            Some('a') => out.push_str(&weekday[..3]),
            Some('H') => out.push_str(&format!("{hour:02}")),
            Some('I') => out.push_str(&format!("{:02}", (hour + 11) % 12 + 1)),
            Some('p') => out.push_str(if hour < 12 { "AM" } else { "PM" }),
            Some('M') => out.push_str(&format!("{minute:02}")),
            Some('S') => out.push_str(&format!("{second:02}")),
            Some('j') => out.push_str(&format!("{:03}", days - days_from_civil(year, 1, 1) + 1)),
            Some('%') => out.push('%'),
            Some(other) => {
                out.push('%');
                out.push(other);
            }
            None => out.push('%'),
        }
    }
    out
}

fn days_from_civil(year: i64, month: u32, day: u32) -> i64 {
    let y = if month <= 2 { year - 1 } else { year };
    let era = y.div_euclid(400);
    let yoe = y.rem_euclid(400);
    let m = i64::from(month);
    let doy = (153 * (if m > 2 { m - 3 } else { m + 9 }) + 2) / 5 + i64::from(day) - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    era * 146_097 + doe - 719_468
}

/// `tojson` as Hugging Face's templates have it: Python's `json.dumps(value, ensure_ascii=False,
/// indent=indent, sort_keys=sort_keys)`. Separators `", "` and `": "` (`","` between items
/// when indenting), keys in their order, non-ASCII text as it is. Models were trained on
/// what that writes, so the spacing matters.
fn tojson(value: Value, kwargs: Kwargs) -> Result<Value, Error> {
    let indent: Option<Value> = kwargs.get("indent")?;
    let sort_keys: Option<bool> = kwargs.get("sort_keys")?;
    let separators: Option<Value> = kwargs.get("separators")?;
    let _: Option<bool> = kwargs.get("ensure_ascii")?;
    kwargs.assert_all_used()?;
    let indent = match indent {
        None => None,
        Some(v) if v.is_none() => None,
        Some(v) => match v.kind() {
            ValueKind::Number => Some(" ".repeat(i64::try_from(v)?.max(0) as usize)),
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            _ => {
                return Err(Error::new(
                    ErrorKind::InvalidOperation,
                    "tojson: indent must be a number or a string",
                ))
            }
        },
    };
    let (item, key) = match separators {
        Some(s) if !s.is_none() => {
            let a = s.get_item(&Value::from(0))?;
            let b = s.get_item(&Value::from(1))?;
            (
                a.as_str().unwrap_or(", ").to_string(),
                b.as_str().unwrap_or(": ").to_string(),
            )
        }
        _ if indent.is_some() => (",".to_string(), ": ".to_string()),
        _ => (", ".to_string(), ": ".to_string()),
    };
    let layout = PyJson {
        indent,
        item,
        key,
        sort_keys: sort_keys.unwrap_or(false),
    };
    let mut out = String::new();
    layout.write(&value, 0, &mut out)?;
    Ok(Value::from_safe_string(out))
}

/// How [`tojson`] lays JSON out.
struct PyJson {
    indent: Option<String>,
    item: String,
    key: String,
    sort_keys: bool,
}

impl PyJson {
    fn newline(&self, depth: usize, out: &mut String) {
        if let Some(indent) = &self.indent {
            out.push('\n');
            for _ in 0..depth {
                out.push_str(indent);
            }
        }
    }

    fn write(&self, value: &Value, depth: usize, out: &mut String) -> Result<(), Error> {
        match value.kind() {
            ValueKind::Undefined | ValueKind::None => out.push_str("null"),
            ValueKind::Bool => out.push_str(if value.is_true() { "true" } else { "false" }),
            ValueKind::Number => {
                if let Ok(i) = i64::try_from(value.clone()) {
                    out.push_str(&i.to_string());
                } else {
                    let f = f64::try_from(value.clone())?;
                    out.push_str(&python_float(f));
                }
            }
            ValueKind::String | ValueKind::Bytes => {
                write_string(value.as_str().unwrap_or_default(), out)
            }
            ValueKind::Seq | ValueKind::Iterable => {
                let items: Vec<Value> = value.try_iter()?.collect();
                if items.is_empty() {
                    out.push_str("[]");
                    return Ok(());
                }
                out.push('[');
                for (i, item) in items.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    self.write(item, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push(']');
            }
            ValueKind::Map => {
                let mut keys: Vec<Value> = value.try_iter()?.collect();
                if self.sort_keys {
                    keys.sort();
                }
                if keys.is_empty() {
                    out.push_str("{}");
                    return Ok(());
                }
                out.push('{');
                for (i, k) in keys.iter().enumerate() {
                    if i > 0 {
                        out.push_str(&self.item);
                    }
                    self.newline(depth + 1, out);
                    match k.as_str() {
                        Some(s) => write_string(s, out),
                        None => write_string(&k.to_string(), out),
                    }
                    out.push_str(&self.key);
                    self.write(&value.get_item(k)?, depth + 1, out)?;
                }
                self.newline(depth, out);
                out.push('}');
            }
            _ => write_string(&value.to_string(), out),
        }
        Ok(())
    }
}

/// A float as Python's `repr` writes it (`1.0`, `0.5`, `1e-07`).
fn python_float(f: f64) -> String {
    if f.is_nan() {
        return "NaN".into();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.into();
    }
    let s = format!("{f:?}");
    if f != 0.0 && (f.abs() >= 1e16 || f.abs() < 1e-4) {
        let e = format!("{f:e}");
        let (mantissa, exp) = e.split_once('e').unwrap_or((&e, "0"));
        let exp: i32 = exp.parse().unwrap_or(0);
        let sign = if exp < 0 { '-' } else { '+' };
        return format!("{mantissa}e{sign}{:02}", exp.abs());
    }
    s
}

/// A JSON string as `json.dumps(..., ensure_ascii=False)` writes it.
fn write_string(s: &str, out: &mut String) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{8}' => out.push_str("\\b"),
            '\u{c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

fn strftime_now(format: String) -> String {
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime(&format, now)
}

impl ChatTemplate {
    /// Compiles a template. `bos_token`/`eos_token` are the texts templates may insert.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, EngineError> {
        let mut env = Environment::new();
        minijinja_contrib::add_to_environment(&mut env);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        // As Hugging Face's apply_chat_template compiles them: a block tag's own line break and
        // the indentation before it are not output.
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.add_template_owned("chat", source.to_string())
            .map_err(|e| {
                EngineError::ChatTemplate(format!("the template does not compile: {e:#}"))
            })?;
        Ok(Self {
            env,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            source: source.into(),
        })
    }

    /// The template's Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Renders a conversation; with `add_generation_prompt` the text ends where the assistant's
    /// reply begins.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render`] with the request's tools (`{"type": "function", "function":
    /// {...}}` objects); none: the template sees no `tools` variable.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String, EngineError> {
        if messages.is_empty() {
            return Err(EngineError::InvalidRequest(
                "a chat needs at least one message".into(),
            ));
        }
        let template = self
            .env
            .get_template("chat")
            .map_err(|e| EngineError::ChatTemplate(e.to_string()))?;
        template
            .render(context! {
                messages => messages,
                tools => (!tools.is_empty()).then_some(tools),
                add_generation_prompt => add_generation_prompt,
                bos_token => self.bos_token,
                eos_token => self.eos_token,
            })
            .map_err(|e| EngineError::ChatTemplate(format!("rendering failed: {e:#}")))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const CHATML: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    #[test]
    fn renders_chatml() {
        let t = ChatTemplate::new(CHATML, "<|im_start|>", "<|im_end|>").unwrap();
        let text = t
            .render(
                &[ChatMessage::new("user", "What is the capital of France?")],
                true,
            )
            .unwrap();
        assert_eq!(
            text,
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n"
        );
    }

    #[test]
    fn supports_the_helpers_templates_use() {
        let source = "{% if messages[0].role == 'tool' %}{{ raise_exception('tool first is not allowed') }}{% endif %}{{ messages[0].content.strip().upper() }}|{{ messages[0].content.startswith(' hi') }}|{{ messages | tojson }}|{{ strftime_now('%Y') | length }}";
        let t = ChatTemplate::new(source, "", "").unwrap();
        let out = t
            .render(&[ChatMessage::new("user", " hi there ")], false)
            .unwrap();
        assert!(out.starts_with("HI THERE|True|[{"), "{out}");
        assert!(out.ends_with("|4"), "{out}");
        let err = t
            .render(&[ChatMessage::new("tool", "x")], false)
            .unwrap_err();
        assert!(
            err.to_string().contains("tool first is not allowed"),
            "{err}"
        );
        let err = ChatTemplate::new("{% for %}", "", "").unwrap_err();
        assert!(err.to_string().contains("does not compile"), "{err}");
    }

    #[test]
    fn strftime_formats_known_dates() {
        // 2024-07-26 13:05:09 UTC, a Friday.
        let t = 1_721_999_109;
        assert_eq!(strftime("%d %b %Y", t), "26 Jul 2024");
        assert_eq!(
            strftime("%A %B %e %H:%M:%S %p %I %j", t),
            "Friday July 26 13:05:09 PM 01 208"
        );
        assert_eq!(strftime("%Y-%m-%d", 0), "1970-01-01");
        assert_eq!(strftime("%Y-%m-%d %a", 951_782_400), "2000-02-29 Tue");
    }
}
