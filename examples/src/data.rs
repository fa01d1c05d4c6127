//! A character-level corpus: vocabulary, encoding, random batches.

use candle_core::{Device, Result, Tensor};

use crate::rng::Rng;

/// The default corpus: this project's README and book, built into the
/// binary (no downloads).
pub const DEFAULT_CORPUS: &[(&str, &str)] = &[
    ("README.md", include_str!("../../README.md")),
    ("docs/guide.md", include_str!("../../docs/guide.md")),
    ("docs/semantics.md", include_str!("../../docs/semantics.md")),
    ("docs/errors.md", include_str!("../../docs/errors.md")),
    (
        "docs/performance.md",
        include_str!("../../docs/performance.md"),
    ),
    (
        "remat-runtime/src/remat.md",
        include_str!("../../remat-runtime/src/remat.md"),
    ),
];

/// The default corpus as one text.
pub fn default_text() -> String {
    DEFAULT_CORPUS
        .iter()
        .map(|(_, t)| *t)
        .collect::<Vec<_>>()
        .join("\n")
}

/// The text of `--data PATH`, or [`default_text`] without one; the error
/// names the flag.
pub fn text(data: Option<&std::path::Path>) -> std::result::Result<String, String> {
    match data {
        Some(path) => {
            std::fs::read_to_string(path).map_err(|e| format!("--data {}: {e}", path.display()))
        }
        None => Ok(default_text()),
    }
}

/// Characters per piece of the split: every tenth piece is held out.
const PIECE: usize = 1000;

/// A text encoded character by character, split into a training part and a
/// held-out part: every tenth piece of 1000 characters (of a tenth of the
/// text, for texts under 10 000 characters) is held out, so the
/// held-out text spreads over the whole corpus (the last tenth of this
/// project's docs would be mostly tables of numbers).
#[derive(Debug, Clone)]
pub struct Corpus {
    /// The characters of the vocabulary, sorted; a token is an index here.
    pub vocab: Vec<char>,
    /// The training tokens.
    pub train: Vec<u32>,
    /// The held-out tokens.
    pub held_out: Vec<u32>,
}

impl Corpus {
    /// Builds the vocabulary of `text` and encodes it.
    pub fn new(text: &str) -> Self {
        let mut vocab: Vec<char> = text.chars().collect();
        vocab.sort_unstable();
        vocab.dedup();
        Self::with_vocab(text, vocab)
    }

    /// Encodes `text` with a given vocabulary (a checkpoint's), skipping
    /// the characters outside it.
    pub fn with_vocab(text: &str, mut vocab: Vec<char>) -> Self {
        vocab.sort_unstable();
        vocab.dedup();
        let tokens: Vec<u32> = text
            .chars()
            .filter_map(|c| vocab.binary_search(&c).ok().map(|i| i as u32))
            .collect();
        Self::split(&tokens, vocab)
    }

    /// Tokens split as characters are: every tenth piece of 1000 tokens (of
    /// a tenth of the tokens, for fewer than 10 000) held out; `vocab` the
    /// characters they index (empty where a tokenizer is the vocabulary).
    pub fn split(tokens: &[u32], vocab: Vec<char>) -> Self {
        let (mut train, mut held_out) = (Vec::new(), Vec::new());
        let piece = PIECE.min(tokens.len() / 10).max(1);
        for (i, piece) in tokens.chunks(piece).enumerate() {
            if i % 10 == 9 {
                held_out.extend_from_slice(piece);
            } else {
                train.extend_from_slice(piece);
            }
        }
        Corpus {
            train,
            held_out,
            vocab,
        }
    }

    /// The number of distinct characters.
    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    /// The tokens of `s`; characters outside the vocabulary are skipped.
    pub fn encode(&self, s: &str) -> Vec<u32> {
        s.chars()
            .filter_map(|c| self.vocab.binary_search(&c).ok().map(|i| i as u32))
            .collect()
    }

    /// The text of `tokens`.
    pub fn decode(&self, tokens: &[u32]) -> String {
        tokens.iter().map(|&t| self.vocab[t as usize]).collect()
    }

    /// Entropy in nats of the training text's character frequencies: the
    /// loss of the best model that ignores context.
    pub fn unigram_entropy(&self) -> f64 {
        let mut counts = vec![0usize; self.vocab.len()];
        for &t in &self.train {
            counts[t as usize] += 1;
        }
        let n = self.train.len() as f64;
        counts
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| {
                let p = c as f64 / n;
                -p * p.ln()
            })
            .sum()
    }

    /// The windows of `seq` tokens of `tokens` that start at `starts`, and
    /// the same windows shifted by one (the targets), as `u32` tensors of
    /// shape `(starts.len(), seq)`; fails if a start leaves fewer than
    /// `seq + 1` tokens.
    pub fn windows(
        tokens: &[u32],
        starts: &[usize],
        seq: usize,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut xs = Vec::with_capacity(starts.len() * seq);
        let mut ys = Vec::with_capacity(starts.len() * seq);
        for &start in starts {
            if start + seq >= tokens.len() {
                candle_core::bail!(
                    "a window of {seq} tokens at {start} does not fit in {} tokens",
                    tokens.len()
                );
            }
            xs.extend_from_slice(&tokens[start..start + seq]);
            ys.extend_from_slice(&tokens[start + 1..start + seq + 1]);
        }
        Ok((
            Tensor::from_vec(xs, (starts.len(), seq), dev)?,
            Tensor::from_vec(ys, (starts.len(), seq), dev)?,
        ))
    }

    /// A batch of `batch` windows of `seq` tokens from `tokens` at random
    /// offsets, and the same windows shifted by one (the targets), as `u32`
    /// tensors of shape `(batch, seq)`.
    pub fn batch(
        tokens: &[u32],
        batch: usize,
        seq: usize,
        rng: &mut Rng,
        dev: &Device,
    ) -> Result<(Tensor, Tensor)> {
        if tokens.len() <= seq + 1 {
            candle_core::bail!(
                "the text has {} tokens: too short for windows of {seq} (use a longer text or a smaller --seq)",
                tokens.len()
            );
        }
        let starts: Vec<usize> = (0..batch)
            .map(|_| rng.below(tokens.len() - seq - 1))
            .collect();
        Self::windows(tokens, &starts, seq, dev)
    }
}
