//! Content-based reject rules (SPEC §6.1, `reference/notes-edges.md` §1).
//!
//! Contract:
//! - `compile` turns a route's `[[reject_rules]]` list (raw TOML) into a `RuleSet`. It never
//!   fails as a whole: an invalid top-level rule is dropped and reported (by name or
//!   `rule<i>`, with the reason); a bad `status`, `name` or `message` is reported and cleared
//!   while the rule is kept. Regular expressions are compiled here, once.
//! - `RuleSet::evaluate` judges the client's original body bytes: parsed once, first matching
//!   top-level rule wins. A body that is empty, not JSON, or a JSON scalar is not evaluated.
//! - Pure: no IO, no clock, no logging, no state between calls. Whether rules are enabled,
//!   the route's default status and hit counters belong to the caller.

use std::borrow::Cow;
use std::cell::Cell;
use std::cmp::Ordering;
use std::fmt;

use serde_json::Value as Json;

use crate::util::show_toml as show;

/// A comparison operator of a leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Gt,
    Ge,
    Lt,
    Le,
    Eq,
    Ne,
    In,
    Nin,
    Match,
    Contains,
    Prefix,
    Exists,
    Absent,
}

impl Op {
    /// Every operator, in the order they are documented.
    pub const ALL: [Op; 13] = [
        Op::Gt,
        Op::Ge,
        Op::Lt,
        Op::Le,
        Op::Eq,
        Op::Ne,
        Op::In,
        Op::Nin,
        Op::Match,
        Op::Contains,
        Op::Prefix,
        Op::Exists,
        Op::Absent,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Op::Gt => "gt",
            Op::Ge => "ge",
            Op::Lt => "lt",
            Op::Le => "le",
            Op::Eq => "eq",
            Op::Ne => "ne",
            Op::In => "in",
            Op::Nin => "nin",
            Op::Match => "match",
            Op::Contains => "contains",
            Op::Prefix => "prefix",
            Op::Exists => "exists",
            Op::Absent => "absent",
        }
    }

    /// The operator named `s` (exact, lower case).
    pub fn parse(s: &str) -> Option<Op> {
        Op::ALL.into_iter().find(|op| op.as_str() == s)
    }
}

/// What a leaf looks at.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Field {
    /// Byte length of the client's original body.
    InputBytes,
    /// Code points of the `messages[].content` text.
    InputChars,
    /// Length of `messages` when it is an array, else 0.
    MessagesCount,
    /// Length of `tools` when it is an array, else 0.
    ToolsCount,
    /// A dotted path through JSON objects (`max_tokens`, `stream`, `metadata.tenant`, ...).
    Path(Vec<String>),
}

impl Field {
    /// The field named `s`; `None` when it names no key (empty, or only dots).
    /// Computed names shadow body keys of the same name.
    pub fn parse(s: &str) -> Option<Field> {
        match s {
            "input_bytes" => Some(Field::InputBytes),
            "input_chars" => Some(Field::InputChars),
            "messages_count" => Some(Field::MessagesCount),
            "tools_count" => Some(Field::ToolsCount),
            _ => {
                let segs: Vec<String> = s
                    .split('.')
                    .filter(|p| !p.is_empty())
                    .map(str::to_string)
                    .collect();
                (!segs.is_empty()).then_some(Field::Path(segs))
            }
        }
    }
}

impl fmt::Display for Field {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Field::InputBytes => f.write_str("input_bytes"),
            Field::InputChars => f.write_str("input_chars"),
            Field::MessagesCount => f.write_str("messages_count"),
            Field::ToolsCount => f.write_str("tools_count"),
            Field::Path(segs) => f.write_str(&segs.join(".")),
        }
    }
}

/// A condition: a leaf comparison or a group.
#[derive(Debug, Clone)]
pub enum Node {
    Leaf {
        field: Field,
        op: Op,
        /// The rule's value (`null` for `exists`/`absent`, which take none).
        value: Json,
        /// The compiled expression of a `match` leaf.
        re: Option<regex::Regex>,
    },
    /// True when every child is (never empty).
    All(Vec<Node>),
    /// True when any child is (never empty).
    Any(Vec<Node>),
}

impl PartialEq for Node {
    fn eq(&self, other: &Node) -> bool {
        match (self, other) {
            (
                Node::Leaf {
                    field: f1,
                    op: o1,
                    value: v1,
                    re: r1,
                },
                Node::Leaf {
                    field: f2,
                    op: o2,
                    value: v2,
                    re: r2,
                },
            ) => {
                f1 == f2
                    && o1 == o2
                    && v1 == v2
                    && r1.as_ref().map(regex::Regex::as_str)
                        == r2.as_ref().map(regex::Regex::as_str)
            }
            (Node::All(a), Node::All(b)) | (Node::Any(a), Node::Any(b)) => a == b,
            _ => false,
        }
    }
}

/// One top-level rule.
#[derive(Debug, Clone, PartialEq)]
pub struct Rule {
    /// The rule's `name`, else `rule<i>` (1-based position in the file).
    pub name: String,
    /// `None` = the route's `reject_rules_status`.
    pub status: Option<u16>,
    /// `None` = `request rejected by rule '<name>'`.
    pub message: Option<String>,
    pub node: Node,
    /// The condition rendered back, e.g. `input_bytes gt 1000 && (model eq "x" || stream eq true)`.
    pub source: String,
}

impl Rule {
    /// The message a rejection by this rule carries.
    pub fn message_or_default(&self) -> Cow<'_, str> {
        match &self.message {
            Some(m) => Cow::Borrowed(m),
            None => Cow::Owned(format!("request rejected by rule '{}'", self.name)),
        }
    }
}

/// A route's compiled rules, in file order (dropped ones left out).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RuleSet {
    pub rules: Vec<Rule>,
}

/// The first rule that matched: its position in `RuleSet::rules` and the rule.
#[derive(Debug, Clone, Copy)]
pub struct Hit<'a> {
    pub index: usize,
    pub rule: &'a Rule,
}

/// One problem found while compiling.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RuleError {
    /// 1-based position of the top-level rule in the list.
    pub index: usize,
    /// True when the rule was dropped; false when only a property was cleared.
    pub dropped: bool,
    /// Names the rule and the reason.
    pub message: String,
}

impl fmt::Display for RuleError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.message)
    }
}

/// Compiles the TOML list. Invalid top-level rules are dropped; each problem yields a message
/// naming the rule and the reason. Never fails as a whole.
pub fn compile(list: &[toml::Value]) -> (RuleSet, Vec<String>) {
    let (set, errors) = compile_report(list);
    (set, errors.into_iter().map(|e| e.message).collect())
}

/// Like `compile`, with each problem's 1-based rule position (for `reject_rules[<i>]`).
pub fn compile_report(list: &[toml::Value]) -> (RuleSet, Vec<RuleError>) {
    let mut rules = Vec::with_capacity(list.len());
    let mut errors = Vec::new();
    for (i, item) in list.iter().enumerate() {
        let index = i + 1;
        let default_name = format!("rule{index}");
        let Some(t) = item.as_table() else {
            errors.push(RuleError {
                index,
                dropped: true,
                message: format!(
                    "rule {default_name:?} dropped: expected a table, found {}",
                    crate::config::toml_type_name(item)
                ),
            });
            continue;
        };
        let mut soft = Vec::new();
        let name = match t.get("name") {
            None => default_name.clone(),
            Some(toml::Value::String(s)) if !s.trim().is_empty() => s.clone(),
            Some(other) => {
                soft.push(format!(
                    "name must be a non-blank string, found {}; named {default_name:?}",
                    show(other)
                ));
                default_name.clone()
            }
        };
        let status = match t.get("status") {
            None => None,
            Some(toml::Value::Integer(s)) if (400..=599).contains(s) => u16::try_from(*s).ok(),
            Some(other) => {
                soft.push(format!(
                    "status {} is not an integer in 400..599; the route's reject_rules_status applies",
                    show(other)
                ));
                None
            }
        };
        let message = match t.get("message") {
            None => None,
            Some(toml::Value::String(s)) => Some(s.clone()),
            Some(other) => {
                soft.push(format!(
                    "message must be a string, found {}; the default message applies",
                    show(other)
                ));
                None
            }
        };
        match compile_node(item, "", &mut soft) {
            Ok(node) => {
                for reason in soft {
                    errors.push(RuleError {
                        index,
                        dropped: false,
                        message: format!("rule {name:?}: {reason}"),
                    });
                }
                let source = render(&node, false);
                rules.push(Rule {
                    name,
                    status,
                    message,
                    node,
                    source,
                });
            }
            Err(reason) => errors.push(RuleError {
                index,
                dropped: true,
                message: format!("rule {name:?} dropped: {reason}"),
            }),
        }
    }
    (RuleSet { rules }, errors)
}

/// Compiles one node; `at` is its position inside the rule (`""` at the top, else like
/// `all[1].any[0]`), prefixed to the reason.
/// Keys a rule's top-level table may hold, and a nested condition's.
const RULE_KEYS: [&str; 8] = [
    "name", "status", "message", "all", "any", "field", "op", "value",
];
const CONDITION_KEYS: [&str; 5] = ["all", "any", "field", "op", "value"];

fn compile_node(v: &toml::Value, at: &str, soft: &mut Vec<String>) -> Result<Node, String> {
    let here = |reason: String| {
        if at.is_empty() {
            reason
        } else {
            format!("{at}: {reason}")
        }
    };
    let Some(t) = v.as_table() else {
        return Err(here(format!(
            "expected a table, found {}",
            crate::config::toml_type_name(v)
        )));
    };
    // A typo (`stauts = 403`) would otherwise leave the default in force, silently.
    let known: &[&str] = if at.is_empty() {
        &RULE_KEYS
    } else {
        &CONDITION_KEYS
    };
    for key in t.keys().filter(|k| !known.contains(&k.as_str())) {
        soft.push(here(
            match crate::config::near_key(key, known.iter().copied()) {
                Some(k) => format!("unknown key {key:?} ignored (did you mean {k:?}?)"),
                None => format!(
                    "unknown key {key:?} ignored (expected one of: {})",
                    known.join(", ")
                ),
            },
        ));
    }
    // `all` wins over `any`, and a group over leaf keys (as the reference).
    for (key, all) in [("all", true), ("any", false)] {
        let Some(children) = t.get(key) else {
            continue;
        };
        let Some(children) = children.as_array() else {
            return Err(here(format!(
                "{key} must be a list of conditions, found {}",
                crate::config::toml_type_name(children)
            )));
        };
        if children.is_empty() {
            return Err(here(format!("{key} must list at least one condition")));
        }
        let mut nodes = Vec::with_capacity(children.len());
        for (j, child) in children.iter().enumerate() {
            let child_at = if at.is_empty() {
                format!("{key}[{j}]")
            } else {
                format!("{at}.{key}[{j}]")
            };
            nodes.push(compile_node(child, &child_at, soft)?);
        }
        return Ok(if all {
            Node::All(nodes)
        } else {
            Node::Any(nodes)
        });
    }
    compile_leaf(t).map_err(here)
}

fn compile_leaf(t: &toml::Table) -> Result<Node, String> {
    let field = match t.get("field") {
        None if !t.contains_key("op") => {
            return Err("a condition needs field and op, or all = [...] / any = [...]".into())
        }
        None => return Err("missing field".into()),
        Some(toml::Value::String(s)) => {
            Field::parse(s).ok_or_else(|| format!("field {s:?} names no key"))?
        }
        Some(other) => return Err(format!("field must be a string, found {}", show(other))),
    };
    let op = match t.get("op") {
        None => return Err("missing op".into()),
        Some(toml::Value::String(s)) => Op::parse(s).ok_or_else(|| {
            let known: Vec<&str> = Op::ALL.iter().map(|o| o.as_str()).collect();
            format!("unknown op {s:?} (expected one of {})", known.join(" "))
        })?,
        Some(other) => return Err(format!("op must be a string, found {}", show(other))),
    };
    let raw = t.get("value");
    let name = op.as_str();
    let value = match (op, raw) {
        // Like the reference, a value given to exists/absent is ignored.
        (Op::Exists | Op::Absent, _) => Json::Null,
        (_, None) => return Err(format!("op {name} needs a value")),
        (_, Some(raw)) => toml_to_json(raw)?,
    };
    let mut re = None;
    match op {
        Op::In | Op::Nin if !value.is_array() => {
            return Err(format!(
                "op {name} needs a list value, found {}",
                json_type(&value)
            ))
        }
        // These could never match anything else (no coercion), so say so at load.
        Op::Gt | Op::Ge | Op::Lt | Op::Le if !value.is_number() => {
            return Err(format!(
                "op {name} needs a number value, found {}",
                json_type(&value)
            ))
        }
        Op::Contains | Op::Prefix if !value.is_string() => {
            return Err(format!(
                "op {name} needs a string value, found {}",
                json_type(&value)
            ))
        }
        Op::Match => {
            let Some(pattern) = value.as_str() else {
                return Err(format!(
                    "op match needs a regular expression string, found {}",
                    json_type(&value)
                ));
            };
            re = Some(
                regex::Regex::new(pattern)
                    .map_err(|e| format!("invalid regular expression {pattern:?}: {e}"))?,
            );
        }
        _ => {}
    }
    Ok(Node::Leaf {
        field,
        op,
        value,
        re,
    })
}

/// TOML → JSON; datetimes become their text, non-finite floats are refused.
fn toml_to_json(v: &toml::Value) -> Result<Json, String> {
    Ok(match v {
        toml::Value::String(s) => Json::String(s.clone()),
        toml::Value::Integer(i) => Json::from(*i),
        toml::Value::Float(f) => serde_json::Number::from_f64(*f)
            .map(Json::Number)
            .ok_or_else(|| format!("value {f} is not a finite number"))?,
        toml::Value::Boolean(b) => Json::Bool(*b),
        toml::Value::Datetime(d) => Json::String(d.to_string()),
        toml::Value::Array(a) => Json::Array(a.iter().map(toml_to_json).collect::<Result<_, _>>()?),
        toml::Value::Table(t) => Json::Object(
            t.iter()
                .map(|(k, x)| Ok((k.clone(), toml_to_json(x)?)))
                .collect::<Result<_, String>>()?,
        ),
    })
}

fn json_type(v: &Json) -> &'static str {
    match v {
        Json::Null => "null",
        Json::Bool(_) => "a boolean",
        Json::Number(_) => "a number",
        Json::String(_) => "a string",
        Json::Array(_) => "a list",
        Json::Object(_) => "a table",
    }
}

/// Renders a node as a readable condition; `nested` groups of several children get
/// parentheses.
fn render(node: &Node, nested: bool) -> String {
    match node {
        Node::Leaf {
            field, op, value, ..
        } => match op {
            Op::Exists | Op::Absent => format!("{field} {}", op.as_str()),
            _ => format!("{field} {} {value}", op.as_str()),
        },
        Node::All(children) | Node::Any(children) if children.len() == 1 => {
            render(&children[0], nested)
        }
        Node::All(children) | Node::Any(children) => {
            let sep = if matches!(node, Node::All(_)) {
                " && "
            } else {
                " || "
            };
            let inner: Vec<String> = children.iter().map(|c| render(c, true)).collect();
            let inner = inner.join(sep);
            if nested {
                format!("({inner})")
            } else {
                inner
            }
        }
    }
}

/// Code points of `s` as the reference counts them: bytes that are not UTF-8 continuation
/// bytes (0x80–0xBF). No allocation.
fn code_points(s: &str) -> u64 {
    s.as_bytes().iter().filter(|&&b| b & 0xC0 != 0x80).count() as u64
}

/// `input_chars`: code points of `messages[].content` (`reference/notes-edges.md`
/// §1.2). Non-array `messages` and non-object elements (incl. `null`) count 0.
fn input_chars(body: &Json) -> u64 {
    let Some(messages) = body.get("messages").and_then(Json::as_array) else {
        return 0;
    };
    let mut n = 0;
    for m in messages {
        match m.get("content") {
            Some(Json::String(s)) => n += code_points(s),
            Some(Json::Array(parts)) => {
                for part in parts {
                    match part {
                        Json::String(s) => n += code_points(s),
                        Json::Object(o) => match (o.get("text"), o.get("content")) {
                            (Some(Json::String(s)), _) => n += code_points(s),
                            (None, Some(Json::String(s))) => n += code_points(s),
                            _ => {}
                        },
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    n
}

/// One evaluation: the parsed body, the raw length, and `input_chars` once computed.
struct Ctx<'a> {
    body: &'a Json,
    bytes: usize,
    chars: Cell<Option<u64>>,
}

impl<'a> Ctx<'a> {
    /// The field's value; `None` = missing.
    fn resolve(&self, field: &Field) -> Option<Cow<'a, Json>> {
        let count = |n: u64| Some(Cow::Owned(Json::from(n)));
        match field {
            Field::InputBytes => count(self.bytes as u64),
            Field::InputChars => {
                let n = match self.chars.get() {
                    Some(n) => n,
                    None => {
                        let n = input_chars(self.body);
                        self.chars.set(Some(n));
                        n
                    }
                };
                count(n)
            }
            Field::MessagesCount => count(array_len(self.body, "messages")),
            Field::ToolsCount => count(array_len(self.body, "tools")),
            Field::Path(segs) => {
                let mut cur = self.body;
                for seg in segs {
                    cur = cur.as_object()?.get(seg)?;
                }
                Some(Cow::Borrowed(cur))
            }
        }
    }

    fn eval(&self, node: &Node) -> bool {
        match node {
            Node::All(children) => children.iter().all(|c| self.eval(c)),
            Node::Any(children) => children.iter().any(|c| self.eval(c)),
            Node::Leaf {
                field,
                op,
                value,
                re,
            } => {
                let got = self.resolve(field);
                leaf(got.as_deref(), *op, value, re.as_ref())
            }
        }
    }
}

fn array_len(body: &Json, key: &str) -> u64 {
    body.get(key)
        .and_then(Json::as_array)
        .map_or(0, |a| a.len() as u64)
}

/// One comparison (notes §1.3); `got` = `None` when the field is missing.
fn leaf(got: Option<&Json>, op: Op, want: &Json, re: Option<&regex::Regex>) -> bool {
    match op {
        Op::Exists => got.is_some(),
        Op::Absent => got.is_none(),
        Op::Ne => match got {
            None => true,
            Some(g) => !json_eq(g, want),
        },
        Op::Nin => match (want.as_array(), got) {
            (None, _) => false,
            (Some(_), None) => true,
            (Some(list), Some(g)) => !list.iter().any(|w| json_eq(g, w)),
        },
        _ => {
            let Some(got) = got else {
                return false;
            };
            match op {
                Op::Gt => num_cmp(got, want).is_some_and(Ordering::is_gt),
                Op::Ge => num_cmp(got, want).is_some_and(Ordering::is_ge),
                Op::Lt => num_cmp(got, want).is_some_and(Ordering::is_lt),
                Op::Le => num_cmp(got, want).is_some_and(Ordering::is_le),
                Op::Eq => json_eq(got, want),
                Op::In => want
                    .as_array()
                    .is_some_and(|list| list.iter().any(|w| json_eq(got, w))),
                Op::Match => match (got.as_str(), re) {
                    (Some(s), Some(re)) => re.is_match(s),
                    _ => false,
                },
                Op::Contains => match (got.as_str(), want.as_str()) {
                    (Some(s), Some(w)) => s.contains(w),
                    _ => false,
                },
                Op::Prefix => match (got.as_str(), want.as_str()) {
                    (Some(s), Some(w)) => s.starts_with(w),
                    _ => false,
                },
                Op::Exists | Op::Absent | Op::Ne | Op::Nin => unreachable!("handled above"),
            }
        }
    }
}

/// Orders two numbers (exactly when both are integers); `None` when either is not a number.
fn num_cmp(a: &Json, b: &Json) -> Option<Ordering> {
    let (Json::Number(a), Json::Number(b)) = (a, b) else {
        return None;
    };
    if let (Some(x), Some(y)) = (a.as_i64(), b.as_i64()) {
        return Some(x.cmp(&y));
    }
    if let (Some(x), Some(y)) = (a.as_u64(), b.as_u64()) {
        return Some(x.cmp(&y));
    }
    a.as_f64()?.partial_cmp(&b.as_f64()?)
}

/// Strict type+value equality, except that numbers compare by value (1 == 1.0).
fn json_eq(a: &Json, b: &Json) -> bool {
    match (a, b) {
        (Json::Number(_), Json::Number(_)) => num_cmp(a, b) == Some(Ordering::Equal),
        (Json::Array(x), Json::Array(y)) => {
            x.len() == y.len() && x.iter().zip(y).all(|(p, q)| json_eq(p, q))
        }
        (Json::Object(x), Json::Object(y)) => {
            x.len() == y.len()
                && x.iter()
                    .all(|(k, p)| y.get(k).is_some_and(|q| json_eq(p, q)))
        }
        _ => a == b,
    }
}

impl RuleSet {
    pub fn is_empty(&self) -> bool {
        self.rules.is_empty()
    }

    pub fn len(&self) -> usize {
        self.rules.len()
    }

    /// Evaluates the client's original body bytes. The body is parsed once (only when there
    /// are rules); an empty body, one that is not JSON, or a JSON scalar is not evaluated
    /// (`None`). A top-level array is evaluated (paths missing, counts 0). First matching
    /// top-level rule wins.
    pub fn evaluate(&self, body: &[u8]) -> Option<Hit<'_>> {
        if self.rules.is_empty() || body.is_empty() {
            return None;
        }
        // JSON that serde_json refuses (a number too large, a lone surrogate, deep
        // nesting) is still JSON to the engine, so it is still evaluated.
        let parsed: Json = crate::lenient_json::parse(body)?;
        if !matches!(parsed, Json::Object(_) | Json::Array(_)) {
            return None;
        }
        let ctx = Ctx {
            body: &parsed,
            bytes: body.len(),
            chars: Cell::new(None),
        };
        self.rules
            .iter()
            .enumerate()
            .find(|(_, r)| ctx.eval(&r.node))
            .map(|(index, rule)| Hit { index, rule })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    /// Compiles `[[reject_rules]]` TOML text.
    fn rules(text: &str) -> (RuleSet, Vec<String>) {
        let t: toml::Table = text.parse().unwrap_or_else(|e| panic!("{e}\n{text}"));
        let list = t
            .get("reject_rules")
            .and_then(toml::Value::as_array)
            .cloned()
            .unwrap_or_default();
        compile(&list)
    }

    /// One valid rule from inline TOML condition keys.
    fn one(cond: &str) -> RuleSet {
        let (set, errs) = rules(&format!("[[reject_rules]]\n{cond}\n"));
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(set.len(), 1);
        set
    }

    fn hits(set: &RuleSet, body: &Json) -> bool {
        set.evaluate(body.to_string().as_bytes()).is_some()
    }

    /// A leaf `field op value` evaluated against `body`.
    fn check(field: &str, op: &str, value: &str, body: Json) -> bool {
        let value = if value.is_empty() {
            String::new()
        } else {
            format!("value = {value}")
        };
        let set = one(&format!("field = \"{field}\"\nop = \"{op}\"\n{value}"));
        hits(&set, &body)
    }

    #[test]
    fn numeric_ops() {
        let b = json!({ "max_tokens": 100, "t": 1.5, "s": "100", "n": null });
        assert!(check("max_tokens", "gt", "99", b.clone()));
        assert!(!check("max_tokens", "gt", "100", b.clone()));
        assert!(check("max_tokens", "ge", "100", b.clone()));
        assert!(check("max_tokens", "ge", "99.5", b.clone()));
        assert!(check("max_tokens", "lt", "100.5", b.clone()));
        assert!(!check("max_tokens", "lt", "100", b.clone()));
        assert!(check("max_tokens", "le", "100", b.clone()));
        assert!(check("t", "gt", "1", b.clone()));
        assert!(check("t", "lt", "2", b.clone()));
        // No coercion: a string field is not a number.
        assert!(!check("s", "gt", "1", b.clone()));
        assert!(!check("s", "lt", "1000", b.clone()));
        // Missing and null never compare.
        assert!(!check("missing", "gt", "0", b.clone()));
        assert!(!check("missing", "lt", "0", b.clone()));
        assert!(!check("n", "ge", "0", b.clone()));
        assert!(!check("n", "le", "0", b.clone()));
        // Large integers compare exactly.
        let big = json!({ "x": 9_007_199_254_740_993u64 });
        assert!(check("x", "gt", "9007199254740992", big));
    }

    #[test]
    fn eq_and_ne() {
        let b = json!({ "model": "m1", "max_tokens": 1, "stream": true, "f": 1.0, "s": "1", "n": null,
                        "arr": [1, "a"], "obj": { "a": 1 } });
        assert!(check("model", "eq", "\"m1\"", b.clone()));
        assert!(!check("model", "eq", "\"M1\"", b.clone()));
        assert!(check("max_tokens", "eq", "1", b.clone()));
        assert!(check("max_tokens", "eq", "1.0", b.clone()), "1 == 1.0");
        assert!(check("f", "eq", "1", b.clone()), "1.0 == 1");
        assert!(!check("s", "eq", "1", b.clone()), "\"1\" is not 1");
        assert!(!check("max_tokens", "eq", "\"1\"", b.clone()));
        assert!(check("stream", "eq", "true", b.clone()));
        assert!(!check("stream", "eq", "1", b.clone()));
        assert!(!check("missing", "eq", "1", b.clone()));
        assert!(!check("n", "eq", "0", b.clone()));
        assert!(!check("n", "eq", "false", b.clone()));
        assert!(check("arr", "eq", "[1.0, \"a\"]", b.clone()));
        assert!(check("obj", "eq", "{ a = 1 }", b.clone()));
        // ne: negation, true when missing, true for null.
        assert!(check("model", "ne", "\"m2\"", b.clone()));
        assert!(!check("model", "ne", "\"m1\"", b.clone()));
        assert!(!check("max_tokens", "ne", "1.0", b.clone()));
        assert!(check("s", "ne", "1", b.clone()));
        assert!(check("missing", "ne", "1", b.clone()));
        assert!(check("n", "ne", "1", b.clone()));
    }

    #[test]
    fn in_and_nin() {
        let b = json!({ "model": "m1", "max_tokens": 2, "n": null });
        assert!(check("model", "in", "[\"m0\", \"m1\"]", b.clone()));
        assert!(!check("model", "in", "[\"m0\"]", b.clone()));
        assert!(check("max_tokens", "in", "[1, 2.0]", b.clone()));
        assert!(!check("max_tokens", "in", "[\"2\"]", b.clone()));
        assert!(!check("missing", "in", "[1]", b.clone()));
        assert!(!check("n", "in", "[1]", b.clone()));
        assert!(check("model", "nin", "[\"m0\"]", b.clone()));
        assert!(!check("model", "nin", "[\"m1\", \"m2\"]", b.clone()));
        assert!(
            check("missing", "nin", "[\"m1\"]", b.clone()),
            "nin true when missing"
        );
        assert!(check("n", "nin", "[1]", b.clone()));
        assert!(check("max_tokens", "nin", "[]", b.clone()));
        assert!(!check("max_tokens", "in", "[]", b));
    }

    #[test]
    fn string_ops() {
        let b = json!({ "model": "qwen3-32b-instruct", "n": null, "num": 12 });
        assert!(check("model", "match", "'^qwen\\d+-\\d+b'", b.clone()));
        assert!(check("model", "match", "\"32b\"", b.clone()), "unanchored");
        assert!(!check("model", "match", "'^llama'", b.clone()));
        assert!(!check("num", "match", "'\\d'", b.clone()), "no coercion");
        assert!(!check("missing", "match", "\".*\"", b.clone()));
        assert!(!check("n", "match", "\".*\"", b.clone()));
        assert!(check("model", "contains", "\"32b\"", b.clone()));
        assert!(!check("model", "contains", "\"70b\"", b.clone()));
        assert!(!check("num", "contains", "\"1\"", b.clone()));
        assert!(!check("missing", "contains", "\"\"", b.clone()));
        assert!(check("model", "prefix", "\"qwen3\"", b.clone()));
        assert!(!check("model", "prefix", "\"32b\"", b.clone()));
        assert!(!check("num", "prefix", "\"1\"", b.clone()));
        assert!(!check("missing", "prefix", "\"\"", b));
    }

    #[test]
    fn exists_and_absent() {
        let b = json!({ "stream": false, "n": null, "metadata": { "tenant": "t1" } });
        assert!(check("stream", "exists", "", b.clone()));
        assert!(check("n", "exists", "", b.clone()), "null is present");
        assert!(!check("n", "absent", "", b.clone()));
        assert!(!check("missing", "exists", "", b.clone()));
        assert!(check("missing", "absent", "", b.clone()));
        assert!(check("metadata.tenant", "exists", "", b.clone()));
        assert!(check("metadata.other", "absent", "", b.clone()));
        // A value given to exists is ignored (as the reference).
        assert!(check("stream", "exists", "false", b));
    }

    #[test]
    fn computed_fields() {
        let body = json!({ "model": "m", "messages": [{ "role": "user", "content": "hello" }] });
        let text = body.to_string();
        let n = text.len();
        assert!(check("input_bytes", "eq", &n.to_string(), body.clone()));
        assert!(check(
            "input_bytes",
            "gt",
            &(n - 1).to_string(),
            body.clone()
        ));
        assert!(!check("input_bytes", "gt", &n.to_string(), body.clone()));
        // Raw bytes, not re-encoded: whitespace counts.
        let set = one("field = \"input_bytes\"\nop = \"eq\"\nvalue = 13");
        assert!(set.evaluate(b"{ \"a\" :  1 } ").is_some());

        assert!(check("messages_count", "eq", "1", body.clone()));
        assert!(check(
            "messages_count",
            "eq",
            "0",
            json!({ "messages": "x" })
        ));
        assert!(check("messages_count", "eq", "0", json!({})));
        assert!(check(
            "messages_count",
            "eq",
            "3",
            json!({ "messages": [1, null, {}] })
        ));
        assert!(check(
            "tools_count",
            "eq",
            "2",
            json!({ "tools": [{}, {}] })
        ));
        assert!(check("tools_count", "eq", "0", json!({ "tools": {} })));
        assert!(check("tools_count", "eq", "0", json!({})));
        // Computed names shadow body keys.
        assert!(check(
            "messages_count",
            "eq",
            "0",
            json!({ "messages_count": 5 })
        ));
        assert!(check(
            "max_tokens",
            "ge",
            "4096",
            json!({ "max_tokens": 8192 })
        ));
        assert!(check("stream", "eq", "true", json!({ "stream": true })));
        assert!(!check("stream", "eq", "true", json!({ "stream": "true" })));
    }

    fn chars_of(body: Json) -> u64 {
        let parsed = body;
        input_chars(&parsed)
    }

    #[test]
    fn input_chars_counting() {
        assert_eq!(chars_of(json!({ "messages": [{ "content": "hello" }] })), 5);
        assert_eq!(
            chars_of(json!({ "messages": [{ "content": "你好世界" }] })),
            4
        );
        assert_eq!(chars_of(json!({ "messages": [{ "content": "a😀b" }] })), 3);
        assert_eq!(chars_of(json!({ "messages": [{ "content": "é" }] })), 1);
        // Summed over messages; other fields are not counted.
        assert_eq!(
            chars_of(json!({
                "system": "ignored", "prompt": "ignored", "tools": [{ "x": "ignored" }],
                "messages": [
                    { "role": "system", "content": "ab", "name": "ignored" },
                    { "role": "assistant", "content": null, "tool_calls": [{ "id": "ignored" }] },
                    { "role": "user", "content": "cd" }
                ]
            })),
            4
        );
        // Array content: text, else content; bare strings; other elements ignored.
        assert_eq!(
            chars_of(json!({ "messages": [{ "content": [
                { "type": "text", "text": "abc" },
                { "type": "tool_result", "content": "de" },
                { "text": 5, "content": "not consulted" },
                { "text": null, "content": "not consulted" },
                { "text": "x", "content": "only text counts" },
                "fg",
                7, null, ["nested"],
                { "type": "image_url", "image_url": { "url": "ignored" } }
            ] }] })),
            3 + 2 + 1 + 2
        );
        // Non-array messages, non-object elements, null element → 0 for that part.
        assert_eq!(chars_of(json!({ "messages": "a string" })), 0);
        assert_eq!(chars_of(json!({ "messages": { "content": "x" } })), 0);
        assert_eq!(chars_of(json!({})), 0);
        assert_eq!(chars_of(json!([1, 2])), 0);
        assert_eq!(
            chars_of(json!({ "messages": [null, "str", 5, { "content": "ok" }] })),
            2
        );
        assert_eq!(chars_of(json!({ "messages": [{ "content": 12 }] })), 0);
        // Through a rule, escapes decoded first: "\u00e9" is one code point.
        let set = one("field = \"input_chars\"\nop = \"eq\"\nvalue = 2");
        assert!(set
            .evaluate(br#"{"messages":[{"content":"\u00e9\ud83d\ude00"}]}"#)
            .is_some());
        assert!(check(
            "input_chars",
            "gt",
            "3",
            json!({ "messages": [{ "content": "你好世界!" }] })
        ));
    }

    #[test]
    fn input_chars_of_a_10_mib_body() {
        // 10 MiB of mixed ASCII, CJK and emoji content; the count is exact.
        let unit = "ab你好😀"; // 2 + 2 + 1 code points, 2 + 6 + 4 bytes
        let reps = (5 << 20) / unit.len() + 1;
        let content = unit.repeat(reps);
        let body = format!(
            r#"{{"model":"m","messages":[{{"role":"user","content":"{content}"}},{{"role":"user","content":[{{"type":"text","text":"{content}"}}]}}]}}"#
        );
        assert!(body.len() > 10 << 20);
        let want = (reps * 5 * 2) as u64;
        let set = one(&format!(
            "field = \"input_chars\"\nop = \"eq\"\nvalue = {want}"
        ));
        assert!(set.evaluate(body.as_bytes()).is_some());
        let set = one(&format!(
            "field = \"input_chars\"\nop = \"gt\"\nvalue = {want}"
        ));
        assert!(set.evaluate(body.as_bytes()).is_none());
    }

    #[test]
    fn input_chars_is_computed_once() {
        let (set, errs) = rules(
            r#"
[[reject_rules]]
all = [ { field = "input_chars", op = "gt", value = 100 }, { field = "input_chars", op = "lt", value = 10 } ]
[[reject_rules]]
name = "mid"
field = "input_chars"
op = "eq"
value = 5
"#,
        );
        assert!(errs.is_empty(), "{errs:?}");
        let body = json!({ "messages": [{ "content": "hello" }] }).to_string();
        let parsed: Json = serde_json::from_str(&body).unwrap();
        let ctx = Ctx {
            body: &parsed,
            bytes: body.len(),
            chars: Cell::new(None),
        };
        assert!(!ctx.eval(&set.rules[0].node));
        assert_eq!(ctx.chars.get(), Some(5));
        // A poisoned memo proves the second lookup does not recount.
        ctx.chars.set(Some(99));
        assert!(!ctx.eval(&set.rules[1].node));
        assert_eq!(set.evaluate(body.as_bytes()).unwrap().rule.name, "mid");
    }

    #[test]
    fn dotted_paths() {
        let b = json!({ "metadata": { "tenant": "acme", "deep": { "x": 1 } },
                        "messages": [{ "content": "a" }], "s": "str" });
        assert!(check("metadata.tenant", "eq", "\"acme\"", b.clone()));
        assert!(!check("metadata.tenant", "eq", "\"other\"", b.clone()));
        assert!(check("metadata.deep.x", "eq", "1", b.clone()));
        assert!(
            check("..metadata..deep.x.", "eq", "1", b.clone()),
            "empty segments skipped"
        );
        // No array indexing; a non-object on the way → missing.
        assert!(check("messages.0", "absent", "", b.clone()));
        assert!(check("messages.0.content", "absent", "", b.clone()));
        assert!(check("s.len", "absent", "", b.clone()));
        assert!(check("metadata.tenant.x", "absent", "", b.clone()));
        assert!(check("metadata", "exists", "", b));
    }

    #[test]
    fn nested_groups() {
        let (set, errs) = rules(
            r#"
[[reject_rules]]
name = "big-or-tenant"
status = 413
message = "too big"
all = [
  { field = "input_bytes", op = "gt", value = 10 },
  { any = [
      { field = "model", op = "eq", value = "x" },
      { all = [ { field = "metadata.tenant", op = "eq", value = "t1" }, { field = "stream", op = "eq", value = true } ] },
  ] },
]
"#,
        );
        assert!(errs.is_empty(), "{errs:?}");
        let r = &set.rules[0];
        assert_eq!(r.name, "big-or-tenant");
        assert_eq!(r.status, Some(413));
        assert_eq!(r.message.as_deref(), Some("too big"));
        assert_eq!(
            r.source,
            r#"input_bytes gt 10 && (model eq "x" || (metadata.tenant eq "t1" && stream eq true))"#
        );
        assert!(hits(&set, &json!({ "model": "x" })));
        assert!(!hits(&set, &json!({ "model": "y" })));
        assert!(hits(
            &set,
            &json!({ "model": "y", "metadata": { "tenant": "t1" }, "stream": true })
        ));
        assert!(!hits(
            &set,
            &json!({ "model": "y", "metadata": { "tenant": "t1" }, "stream": false })
        ));
        assert!(!hits(&set, &json!({ "m": "x" })), "input_bytes too small");
        // all wins over any; a group wins over leaf keys.
        let (set, errs) = rules(
            r#"
[[reject_rules]]
field = "a"
op = "exists"
all = [ { field = "b", op = "exists" } ]
any = [ { field = "c", op = "exists" } ]
"#,
        );
        assert!(errs.is_empty(), "{errs:?}");
        assert_eq!(set.rules[0].source, "b exists");
        assert!(hits(&set, &json!({ "b": 1 })));
        assert!(!hits(&set, &json!({ "a": 1, "c": 1 })));
    }

    #[test]
    fn first_match_wins() {
        let (set, errs) = rules(
            r#"
[[reject_rules]]
field = "model"
op = "eq"
value = "nope"
[[reject_rules]]
field = "messages_count"
op = "gt"
value = 1
[[reject_rules]]
name = "also"
field = "messages_count"
op = "gt"
value = 0
"#,
        );
        assert!(errs.is_empty(), "{errs:?}");
        let two = json!({ "messages": [{}, {}] }).to_string();
        let hit = set.evaluate(two.as_bytes()).unwrap();
        assert_eq!((hit.index, hit.rule.name.as_str()), (1, "rule2"));
        assert_eq!(hit.rule.status, None);
        assert_eq!(
            hit.rule.message_or_default(),
            "request rejected by rule 'rule2'"
        );
        let one_msg = json!({ "messages": [{}] }).to_string();
        let hit = set.evaluate(one_msg.as_bytes()).unwrap();
        assert_eq!((hit.index, hit.rule.name.as_str()), (2, "also"));
        assert!(set.evaluate(b"{}").is_none());
    }

    #[test]
    fn bodies_not_evaluated() {
        let set = one("field = \"missing\"\nop = \"absent\"");
        assert!(set.evaluate(b"").is_none());
        assert!(set.evaluate(b"not json").is_none());
        assert!(set.evaluate(b"{\"a\":").is_none());
        assert!(set.evaluate(b"\"a string\"").is_none());
        assert!(set.evaluate(b"42").is_none());
        assert!(set.evaluate(b"null").is_none());
        assert!(set.evaluate(b"{}").is_some());
        // A top-level array is evaluated: paths missing, counts 0.
        assert!(set.evaluate(b"[1,2]").is_some());
        let set = one("field = \"messages_count\"\nop = \"eq\"\nvalue = 0");
        assert!(set.evaluate(b"[{\"messages\":[1]}]").is_some());
        // An empty set parses nothing.
        assert!(RuleSet::default().evaluate(b"{}").is_none());
    }

    #[test]
    fn invalid_rules_are_dropped_with_reasons() {
        let (set, errs) = rules(
            r#"
[[reject_rules]]
name = "bad-op"
field = "model"
op = "like"
value = "x"
[[reject_rules]]
field = "model"
op = "eq"
[[reject_rules]]
name = "in-scalar"
field = "model"
op = "in"
value = "x"
[[reject_rules]]
name = "bad-re"
field = "model"
op = "match"
value = "qwen(["
[[reject_rules]]
name = "empty-all"
all = []
[[reject_rules]]
name = "bad-status"
status = 200
field = "model"
op = "exists"
[[reject_rules]]
name = "nested-bad"
any = [ { field = "a", op = "exists" }, { all = [ { field = "b", op = "gt", value = "5" } ] } ]
[[reject_rules]]
name = "no-field"
op = "exists"
[[reject_rules]]
name = "nothing"
status = 429
[[reject_rules]]
name = "nin-scalar"
field = "a"
op = "nin"
value = 1
[[reject_rules]]
name = "match-number"
field = "a"
op = "match"
value = 1
[[reject_rules]]
name = "any-not-list"
any = { field = "a", op = "exists" }
[[reject_rules]]
name = "ok"
field = "model"
op = "eq"
value = "x"
"#,
        );
        let names: Vec<&str> = set.rules.iter().map(|r| r.name.as_str()).collect();
        assert_eq!(names, ["bad-status", "ok"]);
        assert_eq!(set.rules[0].status, None, "bad status cleared, rule kept");
        let expect = [
            ("\"bad-op\" dropped", "unknown op \"like\""),
            ("\"rule2\" dropped", "op eq needs a value"),
            ("\"in-scalar\" dropped", "op in needs a list value"),
            ("\"bad-re\" dropped", "invalid regular expression"),
            (
                "\"empty-all\" dropped",
                "all must list at least one condition",
            ),
            ("\"bad-status\"", "status 200 is not an integer in 400..599"),
            (
                "\"nested-bad\" dropped",
                "any[1].all[0]: op gt needs a number value",
            ),
            ("\"no-field\" dropped", "missing field"),
            ("\"nothing\" dropped", "needs field and op, or all"),
            ("\"nin-scalar\" dropped", "op nin needs a list value"),
            (
                "\"match-number\" dropped",
                "op match needs a regular expression",
            ),
            ("\"any-not-list\" dropped", "any must be a list"),
        ];
        assert_eq!(errs.len(), expect.len(), "{errs:#?}");
        for (e, (who, why)) in errs.iter().zip(expect) {
            assert!(
                e.contains(who) && e.contains(why),
                "{e:?} lacks {who} / {why}"
            );
        }
        // Positions are reported for reject_rules[<i>].
        let t: toml::Table = "reject_rules = [ { field = \"a\", op = \"exists\" }, 5, { field = \"\", op = \"eq\", value = 1 }, { field = \"a\", op = \"exists\", status = 600, name = 7, message = 1 } ]".parse().unwrap();
        let (set, errs) = compile_report(t["reject_rules"].as_array().unwrap());
        assert_eq!(set.len(), 2);
        assert_eq!(set.rules[1].name, "rule4");
        assert_eq!(set.rules[1].message, None);
        let got: Vec<(usize, bool)> = errs.iter().map(|e| (e.index, e.dropped)).collect();
        assert_eq!(
            got,
            [(2, true), (3, true), (4, false), (4, false), (4, false)]
        );
        assert!(errs[0]
            .message
            .contains("expected a table, found an integer"));
        assert!(errs[1].message.contains("field \"\" names no key"));
    }

    #[test]
    fn unknown_keys_in_a_rule_are_reported_and_the_rule_kept() {
        let t: toml::Table = r#"reject_rules = [
            { name = "a", field = "model", op = "eq", value = "x", stauts = 403 },
            { name = "b", any = [ { field = "model", op = "eq", value = "y", colour = 1 } ] },
            { name = "c", field = "model", op = "eq", value = "z", status = 403 },
        ]"#
        .parse()
        .unwrap();
        let (set, errs) = compile_report(t["reject_rules"].as_array().unwrap());
        assert_eq!(set.len(), 3, "the rules are kept");
        let got: Vec<(usize, bool)> = errs.iter().map(|e| (e.index, e.dropped)).collect();
        assert_eq!(got, [(1, false), (2, false)], "{errs:#?}");
        assert!(
            errs[0].message.contains("\"stauts\"")
                && errs[0].message.contains("did you mean \"status\"?"),
            "{}",
            errs[0].message
        );
        assert!(
            errs[1].message.contains("any[0]: unknown key \"colour\""),
            "{}",
            errs[1].message
        );
    }

    #[test]
    fn source_rendering() {
        let (set, _) = rules(
            r#"
[[reject_rules]]
any = [ { field = "model", op = "in", value = ["a", "b"] }, { field = "x", op = "absent" } ]
[[reject_rules]]
all = [ { any = [ { field = "x", op = "match", value = "^a\\d" } ] } ]
[[reject_rules]]
field = "input_chars"
op = "ge"
value = 1.5
"#,
        );
        let src: Vec<&str> = set.rules.iter().map(|r| r.source.as_str()).collect();
        assert_eq!(
            src,
            [
                r#"model in ["a","b"] || x absent"#,
                r#"x match "^a\\d""#,
                "input_chars ge 1.5",
            ]
        );
    }

    #[test]
    fn ops_and_fields_parse() {
        for op in Op::ALL {
            assert_eq!(Op::parse(op.as_str()), Some(op));
        }
        assert_eq!(Op::parse("GT"), None);
        assert_eq!(
            Field::parse("max_tokens"),
            Some(Field::Path(vec!["max_tokens".into()]))
        );
        assert_eq!(Field::parse("input_bytes"), Some(Field::InputBytes));
        assert_eq!(Field::parse("."), None);
        assert_eq!(Field::parse(""), None);
    }
}
