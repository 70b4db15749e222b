//! The RFC 6962 (Certificate Transparency) Merkle tree over the log's entries.
//!
//! - leaf hash `SHA-256(0x00 ‖ entry bytes)`, node hash `SHA-256(0x01 ‖ left ‖ right)`, the
//!   empty tree's root `SHA-256("")`;
//! - [`Frontier`]: the root of a growing tree in O(log n) per append (the checkpointer's view);
//! - [`root`], [`inclusion_proof`], [`consistency_proof`]: from the leaf hashes, as the RFC
//!   defines them (O(n) per call, on demand);
//! - [`verify_inclusion`], [`verify_consistency`]: the checks of RFC 9162 §2.1.3.2 and §2.1.4.2,
//!   which a client runs with nothing but the proof and two signed roots.

use sha2::{Digest, Sha256};

/// A SHA-256 digest.
pub type Hash = [u8; 32];

/// `SHA-256(0x00 ‖ data)`.
pub fn leaf_hash(data: &[u8]) -> Hash {
    let mut h = Sha256::new();
    h.update([0u8]);
    h.update(data);
    h.finalize().into()
}

/// `SHA-256(0x01 ‖ left ‖ right)`.
pub fn node_hash(left: &Hash, right: &Hash) -> Hash {
    let mut h = Sha256::new();
    h.update([1u8]);
    h.update(left);
    h.update(right);
    h.finalize().into()
}

/// The root of the empty tree.
pub fn empty_root() -> Hash {
    Sha256::digest([]).into()
}

/// The largest power of two strictly below `n` (n ≥ 2).
fn split(n: usize) -> usize {
    debug_assert!(n >= 2);
    1 << (usize::BITS - 1 - (n - 1).leading_zeros())
}

/// The Merkle tree hash of `leaves` (leaf hashes).
pub fn root(leaves: &[Hash]) -> Hash {
    match leaves.len() {
        0 => empty_root(),
        1 => leaves[0],
        n => {
            let k = split(n);
            node_hash(&root(&leaves[..k]), &root(&leaves[k..]))
        }
    }
}

/// The audit path of leaf `index` in the tree of `leaves` (RFC 6962 §2.1.1); `None` when the
/// index is outside the tree.
pub fn inclusion_proof(leaves: &[Hash], index: usize) -> Option<Vec<Hash>> {
    (index < leaves.len()).then(|| {
        let mut path = Vec::new();
        path_into(leaves, index, &mut path);
        path
    })
}

fn path_into(leaves: &[Hash], m: usize, out: &mut Vec<Hash>) {
    let n = leaves.len();
    if n <= 1 {
        return;
    }
    let k = split(n);
    if m < k {
        path_into(&leaves[..k], m, out);
        out.push(root(&leaves[k..]));
    } else {
        path_into(&leaves[k..], m - k, out);
        out.push(root(&leaves[..k]));
    }
}

/// The consistency proof between the tree of the first `first` leaves and the tree of all of
/// `leaves` (RFC 6962 §2.1.2); `None` when `first` is 0 or beyond the tree.
pub fn consistency_proof(leaves: &[Hash], first: usize) -> Option<Vec<Hash>> {
    if first == 0 || first > leaves.len() {
        return None;
    }
    let mut proof = Vec::new();
    subproof(first, leaves, true, &mut proof);
    Some(proof)
}

fn subproof(m: usize, leaves: &[Hash], complete: bool, out: &mut Vec<Hash>) {
    let n = leaves.len();
    if m == n {
        if !complete {
            out.push(root(leaves));
        }
        return;
    }
    let k = split(n);
    if m <= k {
        subproof(m, &leaves[..k], complete, out);
        out.push(root(&leaves[k..]));
    } else {
        subproof(m - k, &leaves[k..], false, out);
        out.push(root(&leaves[..k]));
    }
}

/// Whether `proof` shows leaf `index` with hash `leaf` inside the tree of `size` leaves whose
/// root is `root` (RFC 9162 §2.1.3.2).
pub fn verify_inclusion(index: u64, size: u64, leaf: &Hash, proof: &[Hash], root: &Hash) -> bool {
    if index >= size {
        return false;
    }
    let (mut f, mut s) = (index, size - 1);
    let mut r = *leaf;
    for p in proof {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            r = node_hash(p, &r);
            if f & 1 == 0 {
                while f & 1 == 0 && f != 0 {
                    f >>= 1;
                    s >>= 1;
                }
            }
        } else {
            r = node_hash(&r, p);
        }
        f >>= 1;
        s >>= 1;
    }
    s == 0 && r == *root
}

/// Whether `proof` shows that the tree of `first` leaves with root `first_root` is a prefix of
/// the tree of `second` leaves with root `second_root` (RFC 9162 §2.1.4.2).
pub fn verify_consistency(
    first: u64,
    second: u64,
    first_root: &Hash,
    second_root: &Hash,
    proof: &[Hash],
) -> bool {
    if first > second {
        return false;
    }
    if first == second {
        return proof.is_empty() && first_root == second_root;
    }
    if first == 0 {
        return proof.is_empty();
    }
    let mut path: Vec<Hash> = Vec::with_capacity(proof.len() + 1);
    if first.is_power_of_two() {
        path.push(*first_root);
    }
    path.extend_from_slice(proof);
    let Some((head, rest)) = path.split_first() else {
        return false;
    };
    let (mut f, mut s) = (first - 1, second - 1);
    while f & 1 == 1 {
        f >>= 1;
        s >>= 1;
    }
    let (mut fr, mut sr) = (*head, *head);
    for c in rest {
        if s == 0 {
            return false;
        }
        if f & 1 == 1 || f == s {
            fr = node_hash(c, &fr);
            sr = node_hash(c, &sr);
            if f & 1 == 0 {
                while f & 1 == 0 && f != 0 {
                    f >>= 1;
                    s >>= 1;
                }
            }
        } else {
            sr = node_hash(&sr, c);
        }
        f >>= 1;
        s >>= 1;
    }
    s == 0 && fr == *first_root && sr == *second_root
}

/// The root of a growing tree, one leaf at a time: the roots of the perfect subtrees that make
/// up the tree so far (at most log₂ n of them).
#[derive(Debug, Clone, Default)]
pub struct Frontier {
    size: u64,
    /// Perfect subtree roots, largest (leftmost) first.
    stack: Vec<Hash>,
}

impl Frontier {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn size(&self) -> u64 {
        self.size
    }

    pub fn push(&mut self, leaf: Hash) {
        let mut node = leaf;
        let mut n = self.size;
        while n & 1 == 1 {
            let left = self.stack.pop().unwrap_or(node);
            node = node_hash(&left, &node);
            n >>= 1;
        }
        self.stack.push(node);
        self.size += 1;
    }

    /// The tree's root: the subtree roots folded from the right.
    pub fn root(&self) -> Hash {
        let mut it = self.stack.iter().rev();
        let Some(last) = it.next() else {
            return empty_root();
        };
        it.fold(*last, |acc, left| node_hash(left, &acc))
    }
}

/// The roots of the first `size` leaves for each of `sizes` (any order, each at most
/// `leaves.len()`), in one pass: O(n + k log n), not O(n) per size.
pub fn roots_at(leaves: &[Hash], sizes: &[u64]) -> Vec<Hash> {
    let mut order: Vec<usize> = (0..sizes.len()).collect();
    order.sort_by_key(|&i| sizes[i]);
    let mut out = vec![empty_root(); sizes.len()];
    let mut frontier = Frontier::new();
    let mut next = leaves.iter();
    for i in order {
        while frontier.size() < sizes[i] {
            match next.next() {
                Some(l) => frontier.push(*l),
                None => break,
            }
        }
        out[i] = frontier.root();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaves(n: usize) -> Vec<Hash> {
        (0..n)
            .map(|i| leaf_hash(format!("entry {i}").as_bytes()))
            .collect()
    }

    #[test]
    fn the_empty_tree_and_the_known_answer() {
        assert_eq!(
            hex::encode(empty_root()),
            "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
        // RFC 6962 test vector: the leaf hash of the empty string.
        assert_eq!(
            hex::encode(leaf_hash(b"")),
            "6e340b9cffb37a989ca544e6bb780a2c78901d3fb33738768511a30617afa01d"
        );
    }

    #[test]
    fn the_frontier_matches_the_recursive_root() {
        let all = leaves(70);
        let mut f = Frontier::new();
        assert_eq!(f.root(), empty_root());
        for (i, l) in all.iter().enumerate() {
            f.push(*l);
            assert_eq!(f.root(), root(&all[..=i]), "size {}", i + 1);
        }
    }

    #[test]
    fn roots_at_many_sizes_match_one_by_one() {
        let all = leaves(40);
        let sizes = [17, 0, 40, 1, 17, 32];
        let roots = roots_at(&all, &sizes);
        for (s, r) in sizes.iter().zip(roots) {
            assert_eq!(r, root(&all[..*s as usize]), "size {s}");
        }
    }

    #[test]
    fn every_inclusion_proof_verifies_and_a_wrong_one_does_not() {
        for n in 1..40 {
            let all = leaves(n);
            let r = root(&all);
            for i in 0..n {
                let p = inclusion_proof(&all, i).unwrap();
                assert!(
                    verify_inclusion(i as u64, n as u64, &all[i], &p, &r),
                    "{i}/{n}"
                );
                let other = leaf_hash(b"forged");
                assert!(!verify_inclusion(i as u64, n as u64, &other, &p, &r));
                if n > 1 {
                    let j = (i + 1) % n;
                    assert!(!verify_inclusion(j as u64, n as u64, &all[i], &p, &r));
                }
            }
            assert!(inclusion_proof(&all, n).is_none());
        }
    }

    #[test]
    fn every_consistency_proof_verifies_and_a_forked_history_does_not() {
        for n in 1..34 {
            let all = leaves(n);
            let second = root(&all);
            for m in 1..=n {
                let p = consistency_proof(&all, m).unwrap();
                let first = root(&all[..m]);
                assert!(
                    verify_consistency(m as u64, n as u64, &first, &second, &p),
                    "{m}/{n}"
                );
                if m < n {
                    let mut forked = all.clone();
                    forked[m - 1] = leaf_hash(b"rewritten");
                    let forked_first = root(&forked[..m]);
                    assert!(!verify_consistency(
                        m as u64,
                        n as u64,
                        &forked_first,
                        &second,
                        &p
                    ));
                }
            }
        }
    }
}
