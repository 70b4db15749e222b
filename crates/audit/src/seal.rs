//! Sealed segments as Apache Parquet files.
//!
//! A sealed segment is split by model (`<model>/YYYY/MM/DD/<first>-<last>.parquet`, the date of
//! the segment's first entry for that model) or, in the per-request layout, one file per entry
//! (`<model>/YYYY/MM/DD/<audit_id>.parquet`). Every row carries its log index and leaf hash,
//! so the files of a range, put back in index order, rebuild the Merkle tree. The segment's
//! manifest (`_manifests/<first>.json`) lists the files with their sha256 and holds the signed
//! checkpoint whose size is the end of the segment.
//!
//! Schema (all columns required; `user` is empty when the request named none):
//!
//! | column | type | what |
//! |---|---|---|
//! | `index` | INT64 | position in the log |
//! | `leaf_hash` | BINARY | `SHA-256(0x00 ‖ entry)` |
//! | `audit_id` | BINARY (UTF8) | the entry's audit id |
//! | `time_ms` | INT64 | ms since the Unix epoch |
//! | `user` | BINARY (UTF8) | the (redacted) user id |
//! | `model` | BINARY (UTF8) | the model, or `_actions` |
//! | `kind` | BINARY (UTF8) | `request` or `action` |
//! | `entry` | BINARY | the entry's exact stored bytes (UTF-8 JSON) |

use std::sync::Arc;

use parquet::basic::Compression;
use parquet::data_type::{ByteArray, ByteArrayType, Int64Type};
use parquet::file::properties::WriterProperties;
use parquet::file::reader::{FileReader, SerializedFileReader};
use parquet::file::writer::SerializedFileWriter;
use parquet::record::RowAccessor;
use parquet::schema::parser::parse_message_type;
use serde::{Deserialize, Serialize};

use crate::checkpoint::Checkpoint;
use crate::merkle::Hash;
use crate::AuditError;

const SCHEMA: &str = "message audit_entry {
  required int64 index;
  required binary leaf_hash;
  required binary audit_id (UTF8);
  required int64 time_ms;
  required binary user (UTF8);
  required binary model (UTF8);
  required binary kind (UTF8);
  required binary entry;
}";

/// One row: an entry with the keys the queries and the verifier need beside it.
#[derive(Debug, Clone, PartialEq)]
pub struct Row {
    pub index: u64,
    pub leaf_hash: Hash,
    pub audit_id: String,
    pub time_ms: u64,
    pub user: String,
    pub model: String,
    pub kind: String,
    pub entry: Vec<u8>,
}

/// How sealed segments are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, Default)]
#[serde(rename_all = "snake_case")]
pub enum Layout {
    /// One file per model per segment (few, large files: cheap PUTs, good compression).
    #[default]
    Segment,
    /// One file per entry (an object per request; many small files).
    Request,
}

/// One sealed file of a segment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SealedFile {
    /// Relative to the sealed root (and to the S3 prefix).
    pub path: String,
    pub sha256: String,
    pub rows: u64,
    pub model: String,
}

/// What a sealed segment holds: its range, its files and the checkpoint at its end.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    /// First index in the segment.
    pub first: u64,
    /// One past the last index.
    pub end: u64,
    pub files: Vec<SealedFile>,
    /// Signed, of tree size `end`.
    pub checkpoint: Checkpoint,
}

impl Manifest {
    pub fn path(first: u64) -> String {
        format!("_manifests/{first:020}.json")
    }
}

/// The relative path of a sealed file.
pub fn file_path(
    layout: Layout,
    model: &str,
    time_ms: u64,
    first: u64,
    last: u64,
    audit_id: &str,
) -> String {
    let model = sanitize(model);
    let date = crate::entry::date_path(time_ms);
    match layout {
        Layout::Segment => format!("{model}/{date}/{first:020}-{last:020}.parquet"),
        Layout::Request => format!("{model}/{date}/{audit_id}.parquet"),
    }
}

/// A model name safe as one path component.
fn sanitize(model: &str) -> String {
    let s: String = model
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.@".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        format!("_{s}")
    } else {
        s
    }
}

/// Encodes rows as one Parquet file (snappy).
pub fn write(rows: &[Row]) -> Result<Vec<u8>, AuditError> {
    let p = |e: parquet::errors::ParquetError| AuditError::Parquet(e.to_string());
    let schema = Arc::new(parse_message_type(SCHEMA).map_err(p)?);
    let props = Arc::new(
        WriterProperties::builder()
            .set_compression(Compression::SNAPPY)
            .set_created_by("rampart-audit".into())
            .build(),
    );
    let mut out = Vec::new();
    let mut writer = SerializedFileWriter::new(&mut out, schema, props).map_err(p)?;
    let mut group = writer.next_row_group().map_err(p)?;
    let mut column = 0;
    while let Some(mut col) = group.next_column().map_err(p)? {
        let ints = |f: fn(&Row) -> u64| rows.iter().map(|r| f(r) as i64).collect::<Vec<_>>();
        let bytes = |f: fn(&Row) -> &[u8]| {
            rows.iter()
                .map(|r| ByteArray::from(f(r).to_vec()))
                .collect::<Vec<_>>()
        };
        match column {
            0 => col
                .typed::<Int64Type>()
                .write_batch(&ints(|r| r.index), None, None),
            3 => col
                .typed::<Int64Type>()
                .write_batch(&ints(|r| r.time_ms), None, None),
            n => {
                let values = match n {
                    1 => bytes(|r| &r.leaf_hash),
                    2 => bytes(|r| r.audit_id.as_bytes()),
                    4 => bytes(|r| r.user.as_bytes()),
                    5 => bytes(|r| r.model.as_bytes()),
                    6 => bytes(|r| r.kind.as_bytes()),
                    _ => bytes(|r| &r.entry),
                };
                col.typed::<ByteArrayType>()
                    .write_batch(&values, None, None)
            }
        }
        .map_err(p)?;
        col.close().map_err(p)?;
        column += 1;
    }
    group.close().map_err(p)?;
    writer.close().map_err(p)?;
    Ok(out)
}

/// Decodes the rows of a Parquet file written by [`write`].
pub fn read(data: Vec<u8>) -> Result<Vec<Row>, AuditError> {
    let p = |e: parquet::errors::ParquetError| AuditError::Parquet(e.to_string());
    let reader = SerializedFileReader::new(bytes::Bytes::from(data)).map_err(p)?;
    let mut rows = Vec::new();
    for row in reader.get_row_iter(None).map_err(p)? {
        let row = row.map_err(p)?;
        let text = |i: usize| row.get_bytes(i).map(|b| b.data().to_vec()).map_err(p);
        let leaf: Hash = text(1)?
            .try_into()
            .map_err(|_| AuditError::Parquet("a leaf hash is not 32 bytes".into()))?;
        let utf8 = |i: usize| row.get_string(i).cloned().map_err(p);
        rows.push(Row {
            index: row.get_long(0).map_err(p)? as u64,
            leaf_hash: leaf,
            audit_id: utf8(2)?,
            time_ms: row.get_long(3).map_err(p)? as u64,
            user: utf8(4)?,
            model: utf8(5)?,
            kind: utf8(6)?,
            entry: text(7)?,
        });
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_round_trip_through_parquet() {
        let rows: Vec<Row> = (0..50)
            .map(|i| Row {
                index: i,
                leaf_hash: crate::merkle::leaf_hash(&[i as u8]),
                audit_id: format!("id-{i}"),
                time_ms: 1_796_083_200_000 + i,
                user: if i % 2 == 0 {
                    String::new()
                } else {
                    format!("u{i}")
                },
                model: "m".into(),
                kind: "request".into(),
                entry: format!("{{\"i\":{i}}}").into_bytes(),
            })
            .collect();
        let data = write(&rows).unwrap();
        assert_eq!(&data[..4], b"PAR1");
        assert_eq!(read(data).unwrap(), rows);
    }

    #[test]
    fn paths_follow_the_layout() {
        let t = 1_796_083_200_000;
        assert_eq!(
            file_path(Layout::Segment, "smollm2", t, 0, 9, "x"),
            "smollm2/2026/12/01/00000000000000000000-00000000000000000009.parquet"
        );
        assert_eq!(
            file_path(Layout::Request, "../etc", t, 0, 9, "abc"),
            "_.._etc/2026/12/01/abc.parquet"
        );
    }
}
