//! The router: which version serves a request, and whether it is mirrored.
//!
//! Sticky by user: a user key (the request's `user`, else the configured user header, else the API
//! key id) is hashed with the release id as salt into a bucket in [0, 1); the user is in the
//! candidate iff `bucket < weight`. The bucket does not depend on the weight, so a user in the
//! candidate at weight `w` stays there at any `w' > w`, and the realised share of distinct users is
//! the weight up to sampling noise (±1 point at 10,000 users). A new release id reshuffles users,
//! so the same users are not always the guinea pigs. A request without any user key is routed by a
//! hash of its request id: not sticky, and `why` says so (`anonymous`).
//!
//! The control (`[routing] control`, on by default): the users just above the candidate's bucket
//! range, `[w, w + min(w, 1 − w))`, are served by a second copy of the stable version, so that
//! the judge compares the candidate with an engine under the same load. As the weight grows
//! control users move to the candidate, never back to the stable's main copy before the release
//! ends.
//!
//! A/B mode: a request naming a configured group gets that group's variant (`group`); the others
//! are split by weight. Shadow mode: everyone is served by the stable; a `shadow_share` of requests
//! (by a hash of the request id) also carry the candidate version to mirror to.
//!
//! Cost: an FNV-1a pass over the salt and key, a splitmix64 finaliser, one comparison, and the
//! `String` of the version (see `benches/route.rs`: well under a microsecond).

use serde::Serialize;

pub use crate::plan::Variant;
use crate::plan::{Mode, Phase, ReleasePlan};

/// What the router knows of a request.
#[derive(Debug, Clone, Copy, Default)]
pub struct RoutingKey<'a> {
    /// The request's `user` field.
    pub user: Option<&'a str>,
    /// The value of the configured user header (`[releases] user_header`).
    pub header_user: Option<&'a str>,
    /// The id of the API key that authenticated the request.
    pub key_id: Option<&'a str>,
    /// The value of the configured group header (`[releases] group_header`), A/B mode.
    pub group: Option<&'a str>,
    pub request_id: &'a str,
}

/// Where a request goes and why; the request's record carries `variant` and `why`.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Route {
    /// The version that serves the request.
    pub version: String,
    pub variant: Variant,
    /// Shadow mode: the candidate version the request is mirrored to (its answer is discarded).
    pub shadow: Option<String>,
    /// `no_release`, `gating`, `awaiting_approval`, `weight`, `paused`, `holding`, `group`,
    /// `anonymous` (no user key: routed by request id, not sticky), `shadow`, `promoted`,
    /// `rolled_back`.
    pub why: &'static str,
}

fn fnv1a(mut hash: u64, bytes: &[u8]) -> u64 {
    for &b in bytes {
        hash ^= u64::from(b);
        hash = hash.wrapping_mul(0x0000_0100_0000_01b3);
    }
    hash
}

fn splitmix64(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// A user's bucket in [0, 1) for a release: FNV-1a over the salt, a separator and the key, then a
/// splitmix64 finaliser so that nearby keys (`user-1`, `user-2`) land far apart. Not a secret
/// hash: a client could choose a user id that lands in a given variant, which only matters for
/// who sees the candidate, not for safety.
pub fn bucket(release_id: &str, user_key: &str) -> f64 {
    let mut h = fnv1a(0xcbf2_9ce4_8422_2325, release_id.as_bytes());
    h = fnv1a(h, &[0xff]);
    h = fnv1a(h, user_key.as_bytes());
    let mixed = splitmix64(h);
    // The top 53 bits as a fraction: exact in an f64, strictly below 1.
    (mixed >> 11) as f64 / (1u64 << 53) as f64
}

/// Shadow mode: whether the request with this id is mirrored (a `routing.shadow_share` of
/// request ids, by their bucket; not by user, so a user's requests are sampled evenly).
/// Only while the release is judged (running, holding or paused): not while it awaits an
/// approval to start or to promote.
pub fn mirrored(plan: &ReleasePlan, request_id: &str) -> bool {
    plan.mode == Mode::Shadow
        && matches!(
            plan.state.phase,
            Phase::Running | Phase::Holding | Phase::Paused
        )
        && plan.routing.shadow_share > 0.0
        && bucket(&plan.state.release_id, request_id) < plan.routing.shadow_share
}

/// Routes one request under the plan's current state.
pub fn route(plan: &ReleasePlan, key: &RoutingKey) -> Route {
    let stable = |why: &'static str| Route {
        version: plan.stable.clone(),
        variant: Variant::Stable,
        shadow: None,
        why,
    };
    let state = &plan.state;
    let candidate = match (&plan.candidate, state.phase) {
        (_, Phase::Idle) => return stable("no_release"),
        (_, Phase::Gating) => return stable("gating"),
        (_, Phase::Promoted) => return stable("promoted"),
        (_, Phase::RolledBack) => return stable("rolled_back"),
        (None, _) => return stable("no_release"),
        (Some(c), _) => c,
    };
    let weight_why = match state.phase {
        Phase::Paused => "paused",
        Phase::Holding => "holding",
        Phase::AwaitingApproval => "awaiting_approval",
        _ => "weight",
    };
    let to_candidate = |why: &'static str| Route {
        version: candidate.clone(),
        variant: Variant::Candidate,
        shadow: None,
        why,
    };
    let to_control = |why: &'static str| Route {
        version: plan.stable.clone(),
        variant: Variant::Control,
        shadow: None,
        why,
    };
    match plan.mode {
        Mode::Shadow => {
            let mirrored = mirrored(plan, key.request_id);
            Route {
                version: plan.stable.clone(),
                variant: Variant::Stable,
                shadow: mirrored.then(|| candidate.clone()),
                why: "shadow",
            }
        }
        Mode::Ab | Mode::Canary => {
            if plan.mode == Mode::Ab {
                if let Some(variant) = key.group.and_then(|g| plan.routing.groups.get(g)) {
                    return match variant {
                        // (`validate` refuses a group served by the control.)
                        Variant::Stable | Variant::Control => stable("group"),
                        Variant::Candidate => to_candidate("group"),
                    };
                }
            }
            let (user_key, why) = match key.user.or(key.header_user).or(key.key_id) {
                Some(u) => (u, weight_why),
                None => (key.request_id, "anonymous"),
            };
            let b = bucket(&state.release_id, user_key);
            if state.weight > 0.0 && b < state.weight {
                to_candidate(why)
            } else if b < state.weight + plan.routing.control_share(state.weight) {
                to_control(why)
            } else {
                stable(why)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn running_plan(mode: Mode, weight: f64) -> ReleasePlan {
        let mut plan = ReleasePlan::new("v1");
        plan.candidate = Some("v2".to_string());
        plan.mode = mode;
        plan.state.phase = Phase::Running;
        plan.state.weight = weight;
        plan.state.release_id = "v1→v2@1700000000000".to_string();
        plan
    }

    fn user_key<'a>(user: &'a str, request_id: &'a str) -> RoutingKey<'a> {
        RoutingKey {
            user: Some(user),
            request_id,
            ..Default::default()
        }
    }

    #[test]
    fn realised_shares_are_within_one_point_and_sticky() {
        let users: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
        let mut previous: Option<Vec<bool>> = None;
        for percent in [5.0, 20.0, 50.0] {
            let plan = running_plan(Mode::Canary, percent / 100.0);
            let assigned: Vec<bool> = users
                .iter()
                .map(|u| route(&plan, &user_key(u, "r")).variant == Variant::Candidate)
                .collect();
            let share = 100.0 * assigned.iter().filter(|&&c| c).count() as f64 / users.len() as f64;
            println!("weight {percent}% → realised {share:.2}%");
            assert!((share - percent).abs() <= 1.0, "{percent}%: {share}%");
            if let Some(before) = &previous {
                for (i, (&was, &is)) in before.iter().zip(&assigned).enumerate() {
                    assert!(!was || is, "user-{i} moved back to stable at {percent}%");
                }
            }
            previous = Some(assigned);
        }
    }

    #[test]
    fn the_control_serves_as_many_users_as_the_candidate_and_feeds_it() {
        let users: Vec<String> = (0..10_000).map(|i| format!("user-{i}")).collect();
        let mut previous: Option<Vec<Variant>> = None;
        for percent in [5.0, 20.0, 50.0] {
            let plan = running_plan(Mode::Canary, percent / 100.0);
            let assigned: Vec<Variant> = users
                .iter()
                .map(|u| route(&plan, &user_key(u, "r")).variant)
                .collect();
            let share = |v: Variant| {
                100.0 * assigned.iter().filter(|&&a| a == v).count() as f64 / users.len() as f64
            };
            let (candidate, control) = (share(Variant::Candidate), share(Variant::Control));
            println!("weight {percent}%: candidate {candidate:.2}%, control {control:.2}%");
            assert!(
                (candidate - percent).abs() <= 1.0,
                "{percent}%: {candidate}"
            );
            assert!(
                (control - percent).abs() <= 1.0,
                "{percent}%: control {control}"
            );
            if let Some(before) = &previous {
                for (i, (was, is)) in before.iter().zip(&assigned).enumerate() {
                    // A candidate user stays; a control user moves on to the candidate or stays.
                    match was {
                        Variant::Candidate => assert_eq!(*is, Variant::Candidate, "user-{i}"),
                        Variant::Control => assert_ne!(*is, Variant::Stable, "user-{i}"),
                        Variant::Stable => {}
                    }
                }
            }
            previous = Some(assigned);
        }
        // The control serves the stable version; off, nobody is routed to it.
        let mut plan = running_plan(Mode::Canary, 0.2);
        let r = users
            .iter()
            .map(|u| route(&plan, &user_key(u, "r")))
            .find(|r| r.variant == Variant::Control)
            .unwrap();
        assert_eq!((r.version.as_str(), r.why), ("v1", "weight"));
        plan.routing.control = false;
        assert!(users
            .iter()
            .all(|u| route(&plan, &user_key(u, "r")).variant != Variant::Control));
    }

    #[test]
    fn the_same_user_gets_the_same_variant_on_every_request() {
        let plan = running_plan(Mode::Canary, 0.3);
        for i in 0..500 {
            let u = format!("u{i}");
            let first = route(&plan, &user_key(&u, "a"));
            let again = route(&plan, &user_key(&u, "b"));
            assert_eq!(first, again);
            assert_eq!(first.why, "weight");
        }
    }

    #[test]
    fn the_user_key_falls_back_to_header_then_key_id_then_request_id() {
        let plan = running_plan(Mode::Canary, 0.5);
        let by_header = RoutingKey {
            header_user: Some("alice"),
            key_id: Some("key-9"),
            request_id: "r1",
            ..Default::default()
        };
        assert_eq!(
            route(&plan, &by_header).variant,
            route(&plan, &user_key("alice", "r2")).variant
        );
        let by_key = RoutingKey {
            key_id: Some("key-9"),
            request_id: "r1",
            ..Default::default()
        };
        assert_eq!(
            route(&plan, &by_key).variant,
            route(&plan, &user_key("key-9", "r2")).variant
        );
        let anonymous = RoutingKey {
            request_id: "r1",
            ..Default::default()
        };
        assert_eq!(route(&plan, &anonymous).why, "anonymous");
    }

    #[test]
    fn phases_outside_a_running_release_route_to_stable() {
        for (phase, why) in [
            (Phase::Idle, "no_release"),
            (Phase::Gating, "gating"),
            (Phase::RolledBack, "rolled_back"),
            (Phase::Promoted, "promoted"),
        ] {
            let mut plan = running_plan(Mode::Canary, 1.0);
            plan.state.phase = phase;
            let r = route(&plan, &user_key("alice", "r"));
            assert_eq!(
                (r.variant, r.version.as_str(), r.why),
                (Variant::Stable, "v1", why)
            );
        }
        // Paused and holding keep the weight.
        for (phase, why) in [(Phase::Paused, "paused"), (Phase::Holding, "holding")] {
            let mut plan = running_plan(Mode::Canary, 1.0);
            plan.state.phase = phase;
            let r = route(&plan, &user_key("alice", "r"));
            assert_eq!((r.variant, r.why), (Variant::Candidate, why));
        }
        // Weight 0 sends nobody to the candidate.
        let plan = running_plan(Mode::Canary, 0.0);
        for i in 0..1000 {
            let u = format!("u{i}");
            assert_eq!(route(&plan, &user_key(&u, "r")).variant, Variant::Stable);
        }
    }

    #[test]
    fn ab_groups_pick_their_variant_and_others_split_by_weight() {
        let mut plan = running_plan(Mode::Ab, 0.0);
        plan.routing
            .groups
            .insert("beta".to_string(), Variant::Candidate);
        plan.routing
            .groups
            .insert("control".to_string(), Variant::Stable);
        let key = |group| RoutingKey {
            user: Some("alice"),
            group,
            request_id: "r",
            ..Default::default()
        };
        let beta = route(&plan, &key(Some("beta")));
        assert_eq!(
            (beta.variant, beta.version.as_str(), beta.why),
            (Variant::Candidate, "v2", "group")
        );
        let control = route(&plan, &key(Some("control")));
        assert_eq!((control.variant, control.why), (Variant::Stable, "group"));
        let unknown = route(&plan, &key(Some("gamma")));
        assert_eq!((unknown.variant, unknown.why), (Variant::Stable, "weight"));
        plan.state.weight = 1.0;
        assert_eq!(route(&plan, &key(None)).variant, Variant::Candidate);
    }

    #[test]
    fn shadow_mirrors_a_share_of_requests_and_serves_stable() {
        let mut plan = running_plan(Mode::Shadow, 0.5);
        plan.routing.shadow_share = 0.2;
        let mut mirrored = 0;
        for i in 0..10_000 {
            let rid = format!("req-{i}");
            let r = route(&plan, &user_key("alice", &rid));
            assert_eq!(
                (r.variant, r.version.as_str(), r.why),
                (Variant::Stable, "v1", "shadow")
            );
            if let Some(v) = r.shadow {
                assert_eq!(v, "v2");
                mirrored += 1;
            }
        }
        let share = mirrored as f64 / 10_000.0;
        assert!((share - 0.2).abs() <= 0.01, "{share}");
        // Awaiting an approval (to start, or to promote after the last step): nothing is
        // mirrored, everyone is still served by the stable.
        plan.state.phase = Phase::AwaitingApproval;
        assert!((0..1000).all(|i| {
            let r = route(&plan, &user_key("alice", &format!("req-{i}")));
            r.shadow.is_none() && r.version == "v1"
        }));
    }

    #[test]
    fn buckets_are_uniform_and_salted() {
        let n = 20_000;
        let mut deciles = [0usize; 10];
        let mut same = 0;
        for i in 0..n {
            let key = format!("user-{i}");
            let b = bucket("rel-a", &key);
            assert!((0.0..1.0).contains(&b));
            deciles[(b * 10.0) as usize] += 1;
            if (bucket("rel-b", &key) < 0.5) == (b < 0.5) {
                same += 1;
            }
        }
        for d in deciles {
            assert!(
                (d as f64 - n as f64 / 10.0).abs() < 0.1 * n as f64 / 10.0,
                "{deciles:?}"
            );
        }
        // Another release id reshuffles: about half keep their side of 0.5.
        assert!((same as f64 / n as f64 - 0.5).abs() < 0.03, "{same}");
    }

    #[test]
    fn variant_serialises_as_a_word() {
        assert_eq!(
            serde_json::to_string(&Variant::Candidate).unwrap(),
            "\"candidate\""
        );
        assert_eq!(
            serde_json::to_string(&Variant::Stable).unwrap(),
            "\"stable\""
        );
    }
}
