//! Shadow releases: a share of the requests the stable answers is mirrored to the candidate, and
//! (with `[routing] control`, the default) to the control, a second copy of the stable. Both
//! mirrored answers are discarded; each leaves a record (`endpoint = "shadow"`, `variant`
//! `candidate` or `control`, `route_reason = "shadow"`) that feeds the judge like any other, and
//! the two answers to the same request are compared: the agreement rate (same text for a
//! generation, with one seed for both when the request set none; same top class or detections
//! for a tensor model; cosine ≥ 0.999 for embeddings).
//!
//! Comparing the candidate with the control rather than with the stable's own answer keeps the
//! comparison fair on one machine: both mirrors run at the same share of the traffic, on engines
//! under the same load, with the same inputs. The mirrors never delay the user's answer (they run
//! on their own task after the guard passed the request) and never outlive a refusal: a mirror
//! the candidate's admission turns away is a refusal in its record, not an error of the version.

use std::sync::Arc;

use record::RecordBuilder;

use crate::backend::{Answer, Generated, Work};
use crate::finish::Delivery;
use crate::finish::Ticket;
use crate::front::Front;
use crate::registry::{Entry, ModelName};

/// What a mirrored request answered, for the comparison.
#[derive(Debug, Clone)]
enum Output {
    Texts(Vec<String>),
    /// Per input: the top class index, or the detected classes sorted.
    Judgements(Vec<Vec<usize>>),
    /// Every floating-point output, flattened, when no judgement was made.
    Values(Vec<f32>),
    Vectors(Vec<Vec<f32>>),
}

/// Whether two mirrored answers to the same request agree.
fn agree(a: &Output, b: &Output) -> bool {
    match (a, b) {
        (Output::Texts(a), Output::Texts(b)) => a == b,
        (Output::Judgements(a), Output::Judgements(b)) => a == b,
        (Output::Values(a), Output::Values(b)) => {
            a.len() == b.len()
                && a.iter()
                    .zip(b)
                    .all(|(x, y)| (x - y).abs() <= 1e-3 * x.abs().max(1.0))
        }
        (Output::Vectors(a), Output::Vectors(b)) => {
            a.len() == b.len() && a.iter().zip(b).all(|(x, y)| cosine(x, y) >= 0.999)
        }
        _ => false,
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    if a.len() != b.len() {
        return 0.0;
    }
    let (mut dot, mut na, mut nb) = (0f64, 0f64, 0f64);
    for (x, y) in a.iter().zip(b) {
        let (x, y) = (f64::from(*x), f64::from(*y));
        dot += x * y;
        na += x * x;
        nb += y * y;
    }
    if na == 0.0 || nb == 0.0 {
        return if na == nb { 1.0 } else { 0.0 };
    }
    dot / (na.sqrt() * nb.sqrt())
}

/// A seed both mirrors share when the request set none (sampled generations are then
/// comparable), from the request id.
fn seed_of(request_id: &str) -> i64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in request_id.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    (h >> 1) as i64
}

/// Mirrors `work` (already screened by the guard) when the request was routed `shadow` and its
/// request id falls in the plan's share. Returns at once; the mirrors run on their own task.
pub fn maybe_mirror(
    front: &Arc<Front>,
    entry: &Entry,
    principal: &str,
    work: &Work,
    record: &RecordBuilder,
) {
    if record.record.route_reason != Some("shadow") {
        return;
    }
    let Some(releases) = front.releases() else {
        return;
    };
    let Some(mirror) = releases.mirror(&entry.name, &record.record.request_id) else {
        return;
    };
    let Some(candidate) = front
        .registry
        .find(&ModelName::versioned(&entry.name, Some(&mirror.candidate)))
    else {
        return;
    };
    let control = mirror.control;
    let mut work = work.clone();
    if let Work::Generate(p) = &mut work {
        // The mirrors' answers are discarded: nothing streams, and both draw with one seed.
        p.stream = false;
        if p.request.sampling.seed.is_none() {
            p.request.sampling.seed = Some(seed_of(&record.record.request_id) as u64);
        }
    }
    let front = Arc::clone(front);
    let principal = principal.to_string();
    let request_id = record.record.request_id.clone();
    let user = record.record.user.clone();
    let name = entry.name.clone();
    tokio::spawn(async move {
        let of = |entry: Arc<Entry>, variant: &'static str, work: Work| {
            mirror_one(
                &front,
                entry,
                work,
                (variant, &request_id, &principal, user.clone()),
            )
        };
        let (answered, reference) = match control {
            Some(control) => {
                let (a, b) = tokio::join!(
                    of(candidate, "candidate", work.clone()),
                    of(control, "control", work)
                );
                (a, Some(b))
            }
            None => (of(candidate, "candidate", work).await, None),
        };
        // Without a control (`[routing] control = false`, or not loaded yet) there is no
        // answer of the stable's to the same request and seed: nothing to compare.
        if let (Some(reference), Some(releases)) = (reference, front.releases()) {
            let agreed = match (answered, reference) {
                (Some(a), Some(b)) => Some(agree(&a, &b)),
                _ => None,
            };
            releases.agreement(&name, agreed);
        }
    });
}

/// One mirrored request through `entry` (its chain included: a fallback away from the version
/// is an error of the version, as for served requests), its record settled; its output.
async fn mirror_one(
    front: &Arc<Front>,
    entry: Arc<Entry>,
    work: Work,
    (variant, request_id, principal, user): (&'static str, &str, &str, Option<String>),
) -> Option<Output> {
    let mut record = front.record(
        format!("{request_id}-{variant}"),
        principal.to_string(),
        "shadow",
    );
    record.record.user = user;
    record.record.model = entry.name.clone();
    record.record.version = entry.version.clone();
    record.record.version_digest = entry.digest.clone();
    record.record.variant = Some(variant);
    record.record.route_reason = Some("shadow");
    record.set_entropy_band(entry.backend.entropy_band());
    let answered = crate::chain::run(front.chain_parts(), entry, work, &mut record).await;
    let output = match answered {
        Ok(answered) => collect(answered, &mut record).await,
        Err(e) => Err(e),
    };
    match output {
        Ok(output) => {
            let _ = crate::front::settle::<()>(&mut record, Ok(&())).await;
            Some(output)
        }
        Err(e) => {
            let _ = crate::front::settle::<()>(&mut record, Err(&e)).await;
            None
        }
    }
}

/// Reads a mirrored answer to its end, filling the record as the protocol encoders do.
async fn collect(
    answered: crate::chain::Answered,
    record: &mut RecordBuilder,
) -> Result<Output, crate::error::ApiError> {
    match answered.answer {
        Answer::Generation(g) => {
            record.record.prompt_tokens = g.prompt_tokens;
            // Finished as a served answer is (crate::finish), its tokens charged to no key.
            let ticket = Ticket::unpaid(answered.slot);
            let mut delivery = Delivery::new(g, answered.entry, ticket, false, record);
            let mut done = false;
            while !done {
                let Some((i, event)) = delivery.next().await else {
                    return Err(crate::error::ApiError::Unavailable {
                        message: "the engine stopped before the mirrored request finished".into(),
                        retry_after_s: 5,
                    });
                };
                match event {
                    Generated::Token(t) => delivery.on_token(record, i, &t),
                    Generated::Finished(f) => done = delivery.on_finished(i, &f),
                    Generated::Failed(e) => return Err(e.into()),
                }
            }
            delivery.finish(record)?;
            Ok(Output::Texts(delivery.take_texts()))
        }
        Answer::Embeddings(e) => Ok(Output::Vectors(e.vectors)),
        Answer::Tensors(t) => {
            if !t.judgements.is_empty() {
                let per_input = t
                    .judgements
                    .iter()
                    .map(|j| match j {
                        classic::Judgement::Classes(c) => {
                            c.first().map(|c| c.index).into_iter().collect()
                        }
                        classic::Judgement::Detections(d) => {
                            let mut classes: Vec<usize> = d.iter().map(|d| d.class).collect();
                            classes.sort_unstable();
                            classes
                        }
                    })
                    .collect();
                return Ok(Output::Judgements(per_input));
            }
            let values = t
                .outputs
                .iter()
                .flat_map(|o| match &o.tensor.data {
                    classic::Data::F32(v) => v.clone(),
                    _ => Vec::new(),
                })
                .collect();
            Ok(Output::Values(values))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn answers_agree_when_they_match() {
        let t = |s: &[&str]| Output::Texts(s.iter().map(|s| s.to_string()).collect());
        assert!(agree(&t(&["Paris"]), &t(&["Paris"])));
        assert!(!agree(&t(&["Paris"]), &t(&["Lyon"])));
        let j = |v: Vec<Vec<usize>>| Output::Judgements(v);
        assert!(agree(&j(vec![vec![1]]), &j(vec![vec![1]])));
        assert!(!agree(&j(vec![vec![1]]), &j(vec![vec![0]])));
        let v = |v: Vec<f32>| Output::Values(v);
        assert!(agree(&v(vec![1.0, 2.0]), &v(vec![1.0004, 2.001])));
        assert!(!agree(&v(vec![1.0, 2.0]), &v(vec![1.0, 2.1])));
        let e = |v: Vec<Vec<f32>>| Output::Vectors(v);
        assert!(agree(
            &e(vec![vec![1.0, 0.0]]),
            &e(vec![vec![0.9999, 0.001]])
        ));
        assert!(!agree(&e(vec![vec![1.0, 0.0]]), &e(vec![vec![0.0, 1.0]])));
        assert!(!agree(&t(&["x"]), &v(vec![1.0])));
    }

    #[test]
    fn the_shared_seed_depends_on_the_request_only() {
        assert_eq!(seed_of("req-1"), seed_of("req-1"));
        assert_ne!(seed_of("req-1"), seed_of("req-2"));
        assert!(seed_of("req-1") >= 0);
    }
}
