//! The byte-level alphabet of GPT-2-style BPE vocabularies: every byte is written as one visible
//! character (printable bytes as themselves, the rest shifted to code points from 256 up), so
//! token texts in GGUF and `tokenizer.json` files are strings of these characters.

/// The character standing for each byte, indexed by byte.
pub fn byte_chars() -> [char; 256] {
    let mut out = ['\0'; 256];
    let mut next = 256u32;
    for (b, slot) in out.iter_mut().enumerate() {
        let b = b as u32;
        let printable =
            (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
        let code = if printable {
            b
        } else {
            next += 1;
            next - 1
        };
        *slot = char::from_u32(code).expect("code points below 512 are valid chars");
    }
    out
}

/// The one-character token of each byte, as strings (a BPE vocabulary's first 256 entries).
pub fn gpt2_byte_tokens() -> Vec<String> {
    byte_chars().iter().map(|c| c.to_string()).collect()
}

/// The byte a character stands for, for every character of the alphabet.
pub fn char_to_byte() -> std::collections::HashMap<char, u8> {
    byte_chars()
        .iter()
        .enumerate()
        .map(|(b, &c)| (c, b as u8))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alphabet_is_a_bijection() {
        let tokens = gpt2_byte_tokens();
        assert_eq!(tokens.len(), 256);
        let distinct: std::collections::HashSet<&String> = tokens.iter().collect();
        assert_eq!(distinct.len(), 256);
        assert_eq!(tokens[b' ' as usize], "Ġ");
        assert_eq!(tokens[b'\n' as usize], "Ċ");
        assert_eq!(tokens[b'a' as usize], "a");
        let back = char_to_byte();
        for (b, c) in byte_chars().iter().enumerate() {
            assert_eq!(back[c] as usize, b);
        }
    }
}
