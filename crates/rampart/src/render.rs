//! Human-readable numbers and aligned tables for terminal output.

/// `98.4 MB`, `6.8 MB`, `512 B` (decimal units, as model cards use).
pub fn bytes(n: u64) -> String {
    const UNITS: [&str; 5] = ["B", "kB", "MB", "GB", "TB"];
    let mut value = n as f64;
    let mut unit = 0;
    while value >= 1000.0 && unit < UNITS.len() - 1 {
        value /= 1000.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("{value:.1} {}", UNITS[unit])
    }
}

/// `134.5M`, `22.7M`, `1.2B`, `950`.
pub fn count(n: u64) -> String {
    match n {
        0..=999 => n.to_string(),
        1_000..=999_999 => format!("{:.1}K", n as f64 / 1e3),
        1_000_000..=999_999_999 => format!("{:.1}M", n as f64 / 1e6),
        _ => format!("{:.1}B", n as f64 / 1e9),
    }
}

/// A float as people write it: `100000`, `0.5`, `1e-5`, `1e-12`.
pub fn float(v: f64) -> String {
    if v != 0.0 && v.abs() < 1e-3 {
        format!("{v:e}")
    } else {
        v.to_string()
    }
}

/// Rows of cells printed with columns padded to the widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let columns = header.len();
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (i, cell) in row.iter().enumerate().take(columns) {
            widths[i] = widths[i].max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let mut out = String::new();
        for (i, cell) in cells.iter().enumerate() {
            if i + 1 == cells.len() {
                out.push_str(cell);
            } else {
                out.push_str(&format!("{cell:<width$}  ", width = widths[i]));
            }
        }
        out.trim_end().to_string() + "\n"
    };
    let mut out = line(header.to_vec());
    for row in rows {
        out.push_str(&line(row.iter().map(String::as_str).collect()));
    }
    out
}

/// A `key  value` section with aligned keys.
pub struct Section {
    title: String,
    rows: Vec<(String, String)>,
}

impl Section {
    pub fn new(title: impl Into<String>) -> Self {
        Self {
            title: title.into(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, key: &str, value: impl Into<String>) -> &mut Self {
        self.rows.push((key.to_string(), value.into()));
        self
    }

    /// Adds a row only when there is a value.
    pub fn opt<T: ToString>(&mut self, key: &str, value: Option<T>) -> &mut Self {
        if let Some(v) = value {
            self.rows.push((key.to_string(), v.to_string()));
        }
        self
    }

    pub fn render(&self) -> String {
        let width = self
            .rows
            .iter()
            .map(|(k, _)| k.chars().count())
            .max()
            .unwrap_or(0);
        let mut out = format!("{}\n", self.title);
        for (k, v) in &self.rows {
            let mut lines = v.lines();
            out.push_str(&format!("  {k:<width$}  {}\n", lines.next().unwrap_or("")));
            for more in lines {
                out.push_str(&format!("  {:<width$}  {more}\n", ""));
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn formats_numbers() {
        assert_eq!(bytes(98_362_432), "98.4 MB");
        assert_eq!(bytes(512), "512 B");
        assert_eq!(count(134_515_008), "134.5M");
        assert_eq!(count(950), "950");
        assert_eq!(float(1e-5), "1e-5");
        assert_eq!(float(1e-12), "1e-12");
        assert_eq!(float(100000.0), "100000");
    }

    #[test]
    fn aligns_tables() {
        let t = table(&["A", "BB"], &[vec!["long".into(), "x".into()]]);
        assert_eq!(t, "A     BB\nlong  x\n");
    }
}
