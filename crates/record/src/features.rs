//! The features a request's monitors read: named numbers and categories, filled where the
//! input is at hand (decoded images) and carried to the monitor sink in the envelope.

use std::borrow::Cow;

/// A feature's value: a number, or a category (the predicted label, the dominant script).
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    Num(f64),
    Cat(String),
}

/// The features of one request (or one image of a batch).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Observation {
    pub values: Vec<(Cow<'static, str>, Value)>,
}

impl Observation {
    pub fn num(&mut self, name: impl Into<Cow<'static, str>>, v: f64) {
        if v.is_finite() {
            self.values.push((name.into(), Value::Num(v)));
        }
    }

    pub fn cat(&mut self, name: impl Into<Cow<'static, str>>, v: impl Into<String>) {
        self.values.push((name.into(), Value::Cat(v.into())));
    }

    pub fn extend(&mut self, other: Observation) {
        self.values.extend(other.values);
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn get(&self, name: &str) -> Option<&Value> {
        self.values.iter().find(|(n, _)| n == name).map(|(_, v)| v)
    }
}
