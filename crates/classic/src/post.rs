//! Post-processing: softmax and top-k for classifiers; detector heads decoded to boxes and
//! filtered by class-aware non-maximum suppression.

use repo::pipeline::{Decoder, Detect};
use serde::Serialize;

use crate::error::ClassicError;
use crate::imageops::Transform;
use crate::tensor::Tensor;

/// Softmax over each row of `width` values, in place.
pub fn softmax_rows(values: &mut [f32], width: usize) {
    for row in values.chunks_mut(width) {
        let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        let mut sum = 0.0;
        for v in row.iter_mut() {
            *v = (*v - max).exp();
            sum += *v;
        }
        for v in row.iter_mut() {
            *v /= sum;
        }
    }
}

/// One class of a classification.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Class {
    pub index: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub score: f32,
}

/// The `k` best classes of one row, best first (ties: lower index first).
pub fn top_k(row: &[f32], k: usize, labels: Option<&[String]>) -> Vec<Class> {
    let mut order: Vec<usize> = (0..row.len()).collect();
    order.sort_by(|a, b| row[*b].total_cmp(&row[*a]).then(a.cmp(b)));
    order
        .into_iter()
        .take(k)
        .map(|i| Class {
            index: i,
            label: labels.and_then(|l| l.get(i)).cloned(),
            score: row[i],
        })
        .collect()
}

/// A detected object, its box in original-image pixels `[x1, y1, x2, y2]`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Detection {
    pub class: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub label: Option<String>,
    pub score: f32,
    #[serde(rename = "box")]
    pub bbox: [f32; 4],
}

fn iou(a: &[f32; 4], b: &[f32; 4]) -> f32 {
    let iw = (a[2].min(b[2]) - a[0].max(b[0])).max(0.0);
    let ih = (a[3].min(b[3]) - a[1].max(b[1])).max(0.0);
    let inter = iw * ih;
    let area = |r: &[f32; 4]| (r[2] - r[0]).max(0.0) * (r[3] - r[1]).max(0.0);
    inter / (area(a) + area(b) - inter + 1e-5)
}

/// Greedy NMS: highest score first, drop boxes overlapping a kept one of the same class (any
/// class when `class_agnostic`) by more than `iou_threshold`; at most `max` kept.
pub fn nms(
    mut candidates: Vec<Detection>,
    iou_threshold: f32,
    class_agnostic: bool,
    max: usize,
) -> Vec<Detection> {
    candidates.sort_by(|a, b| b.score.total_cmp(&a.score));
    let mut kept: Vec<Detection> = Vec::new();
    for c in candidates {
        if kept.len() >= max {
            break;
        }
        let suppressed = kept.iter().any(|k| {
            (class_agnostic || k.class == c.class) && iou(&k.bbox, &c.bbox) > iou_threshold
        });
        if !suppressed {
            kept.push(c);
        }
    }
    kept
}

fn need(cond: bool, msg: impl FnOnce() -> String) -> Result<(), ClassicError> {
    if cond {
        Ok(())
    } else {
        Err(ClassicError::Backend(msg()))
    }
}

/// Keeps the `k` highest-scoring candidates.
fn keep_top(mut c: Vec<Detection>, k: usize) -> Vec<Detection> {
    if c.len() > k {
        c.select_nth_unstable_by(k, |a, b| b.score.total_cmp(&a.score));
        c.truncate(k);
    }
    c
}

/// Decodes the outputs of one image (`item` along the batch axis) into detections in network
/// coordinates (before NMS). `input_hw` is the network input's height and width.
pub fn decode(
    spec: &Detect,
    outputs: &[Tensor],
    item: usize,
    input_hw: (usize, usize),
) -> Result<Vec<Detection>, ClassicError> {
    let threshold = spec.score_threshold;
    let mut found = Vec::new();
    match spec.decoder {
        Decoder::Picodet => {
            let n = spec.strides.len();
            need(outputs.len() == 2 * n, || {
                format!("picodet: expected {} outputs, got {}", 2 * n, outputs.len())
            })?;
            let bins = spec.reg_max as usize + 1;
            for (level, stride) in spec.strides.iter().enumerate() {
                let (scores, boxes) = (&outputs[level], &outputs[n + level]);
                let stride = *stride as usize;
                let (fh, fw) = (input_hw.0.div_ceil(stride), input_hw.1.div_ceil(stride));
                let cells = fh * fw;
                let s = scores.to_f32().unwrap_or_default();
                let b = boxes.to_f32().unwrap_or_default();
                let classes = *scores.shape.last().unwrap_or(&0);
                need(
                    classes > 0 && s.len() >= (item + 1) * cells * classes,
                    || {
                        format!("picodet: score map {:?} does not hold {cells} cells of stride {stride}", scores.shape)
                    },
                )?;
                need(b.len() >= (item + 1) * cells * 4 * bins, || {
                    format!(
                        "picodet: box map {:?} does not hold {cells} cells x 4 x {bins} bins",
                        boxes.shape
                    )
                })?;
                let s = &s[item * cells * classes..(item + 1) * cells * classes];
                let b = &b[item * cells * 4 * bins..(item + 1) * cells * 4 * bins];
                for cell in 0..cells {
                    let row = &s[cell * classes..(cell + 1) * classes];
                    // Every class above the threshold is a candidate (NMS runs per class).
                    if !row.iter().any(|v| *v > threshold) {
                        continue;
                    }
                    let cx = ((cell % fw) as f32 + 0.5) * stride as f32;
                    let cy = ((cell / fw) as f32 + 0.5) * stride as f32;
                    let mut d = [0f32; 4];
                    for (side, dist) in d.iter_mut().enumerate() {
                        let mut logits =
                            b[(cell * 4 + side) * bins..(cell * 4 + side + 1) * bins].to_vec();
                        softmax_rows(&mut logits, bins);
                        *dist = logits
                            .iter()
                            .enumerate()
                            .map(|(i, p)| i as f32 * p)
                            .sum::<f32>()
                            * stride as f32;
                    }
                    let bbox = [cx - d[0], cy - d[1], cx + d[2], cy + d[3]];
                    for (class, score) in row.iter().copied().enumerate() {
                        if score > threshold {
                            found.push(Detection {
                                class,
                                label: None,
                                score,
                                bbox,
                            });
                        }
                    }
                }
            }
        }
        Decoder::Yolov5 | Decoder::Yolov8 => {
            let out = &outputs[0];
            need(out.shape.len() == 3, || {
                format!(
                    "{:?}: expected an output of rank 3, got {:?}",
                    spec.decoder, out.shape
                )
            })?;
            let v = out.to_f32().unwrap_or_default();
            let (d1, d2) = (out.shape[1], out.shape[2]);
            let item_data = &v[item * d1 * d2..(item + 1) * d1 * d2];
            // v5: [anchors, 5 + classes]; v8: [4 + classes, anchors].
            let (anchors, width, transposed, extra) = match spec.decoder {
                Decoder::Yolov5 => (d1, d2, false, 5),
                _ => (d2, d1, true, 4),
            };
            need(width > extra, || {
                format!(
                    "{:?}: output {:?} holds no classes",
                    spec.decoder, out.shape
                )
            })?;
            let at = |a: usize, f: usize| {
                if transposed {
                    item_data[f * anchors + a]
                } else {
                    item_data[a * width + f]
                }
            };
            for a in 0..anchors {
                let objectness = if extra == 5 { at(a, 4) } else { 1.0 };
                if objectness <= threshold {
                    continue;
                }
                let (mut class, mut best) = (0, f32::NEG_INFINITY);
                for c in 0..width - extra {
                    let s = at(a, extra + c);
                    if s > best {
                        (class, best) = (c, s);
                    }
                }
                let score = best * objectness;
                if score <= threshold {
                    continue;
                }
                let (cx, cy, w, h) = (at(a, 0), at(a, 1), at(a, 2), at(a, 3));
                found.push(Detection {
                    class,
                    label: None,
                    score,
                    bbox: [cx - w / 2.0, cy - h / 2.0, cx + w / 2.0, cy + h / 2.0],
                });
            }
        }
    }
    Ok(keep_top(found, spec.pre_nms_top_k as usize))
}

/// Decode, NMS, map back to the original image, attach labels.
pub fn detect(
    spec: &Detect,
    outputs: &[Tensor],
    item: usize,
    input_hw: (usize, usize),
    transform: &Transform,
    labels: Option<&[String]>,
) -> Result<Vec<Detection>, ClassicError> {
    let candidates = decode(spec, outputs, item, input_hw)?;
    let mut kept = nms(
        candidates,
        spec.iou_threshold,
        spec.class_agnostic,
        spec.max_detections as usize,
    );
    for d in &mut kept {
        d.bbox = transform.to_original(d.bbox);
        d.label = labels.and_then(|l| l.get(d.class)).cloned();
    }
    Ok(kept)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tensor::Data;

    fn det(class: usize, score: f32, bbox: [f32; 4]) -> Detection {
        Detection {
            class,
            label: None,
            score,
            bbox,
        }
    }

    #[test]
    fn nms_is_class_aware_unless_told_otherwise() {
        let boxes = vec![
            det(0, 0.9, [0.0, 0.0, 10.0, 10.0]),
            det(0, 0.8, [1.0, 1.0, 11.0, 11.0]),
            det(1, 0.7, [1.0, 1.0, 11.0, 11.0]),
            det(0, 0.6, [50.0, 50.0, 60.0, 60.0]),
        ];
        let kept = nms(boxes.clone(), 0.5, false, 100);
        assert_eq!(
            kept.iter().map(|d| d.score).collect::<Vec<_>>(),
            vec![0.9, 0.7, 0.6]
        );
        let kept = nms(boxes.clone(), 0.5, true, 100);
        assert_eq!(
            kept.iter().map(|d| d.score).collect::<Vec<_>>(),
            vec![0.9, 0.6]
        );
        assert_eq!(nms(boxes, 0.5, false, 1).len(), 1);
    }

    #[test]
    fn top_k_orders_scores_and_attaches_labels() {
        let labels: Vec<String> = ["0", "90", "180", "270"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        let top = top_k(&[0.1, 0.6, 0.05, 0.25], 2, Some(&labels));
        assert_eq!(top[0].label.as_deref(), Some("90"));
        assert_eq!(top[1].index, 3);
        let mut v = vec![1.0, 2.0, 3.0];
        softmax_rows(&mut v, 3);
        assert!((v.iter().sum::<f32>() - 1.0).abs() < 1e-6 && v[2] > v[1]);
    }

    #[test]
    fn picodet_decodes_a_cell_to_its_box() {
        // One stride-8 level over a 16x16 input: 2x2 cells, 2 classes, reg_max 1 (2 bins).
        let spec: Detect = toml::from_str(
            "decoder = \"picodet\"\nstrides = [8]\nreg_max = 1\nscore_threshold = 0.5",
        )
        .unwrap();
        let mut scores = vec![0.0f32; 4 * 2];
        scores[3 * 2 + 1] = 0.9; // cell (1,1), class 1
        let mut dist = vec![0.0f32; 4 * 4 * 2];
        for side in 0..4 {
            // Bin 1 certain: distance 1 * stride = 8 on every side.
            dist[(3 * 4 + side) * 2 + 1] = 20.0;
        }
        let outputs = vec![
            Tensor::new("s", vec![1, 4, 2], Data::F32(scores)).unwrap(),
            Tensor::new("b", vec![1, 4, 8], Data::F32(dist)).unwrap(),
        ];
        let found = decode(&spec, &outputs, 0, (16, 16)).unwrap();
        assert_eq!(found.len(), 1);
        assert_eq!(found[0].class, 1);
        let b = found[0].bbox;
        // Centre (12, 12), distances 8.
        for (got, want) in b.iter().zip([4.0, 4.0, 20.0, 20.0]) {
            assert!((got - want).abs() < 1e-3, "{b:?}");
        }
    }

    #[test]
    fn yolo_heads_decode_centre_boxes() {
        let spec: Detect = toml::from_str("decoder = \"yolov8\"\nscore_threshold = 0.3").unwrap();
        // [1, 4 + 2 classes, 2 anchors], transposed layout.
        let v = vec![
            10.0, 50.0, // cx
            10.0, 50.0, // cy
            4.0, 8.0, // w
            6.0, 8.0, // h
            0.1, 0.9, // class 0
            0.8, 0.05, // class 1
        ];
        let out = Tensor::new("o", vec![1, 6, 2], Data::F32(v)).unwrap();
        let mut found = decode(&spec, &[out], 0, (64, 64)).unwrap();
        found.sort_by_key(|d| d.class);
        assert_eq!(found[0].bbox, [46.0, 46.0, 54.0, 54.0]);
        assert_eq!(found[1].bbox, [8.0, 7.0, 12.0, 13.0]);
    }
}
