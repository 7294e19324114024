//! Test hook: forced model outputs. The tiny test models have random weights, so what they
//! sample is noise; to exercise reasoning, tool calls and exact replay end to end, a script
//! can force the tokens of a chosen text. The engine still prefills and decodes every forced
//! token (KV state, prefix reuse and disk checkpoints are real); only sampling is replaced.
//! Not a user feature: the binary exposes it as a hidden `--test-script FILE`.

use serde::Deserialize;

/// One rule: when the prompt's last user turn contains `when`, the model "says" `output`
/// (tokenized like a rendered prompt, so `</think>` is the control token), then EOS.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct Rule {
    pub when: String,
    pub output: String,
}

#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Script {
    pub rules: Vec<Rule>,
}

/// `<｜User｜>`: the script matches the text after the last one.
const USER: &str = ds4_chat::tokenizer::USER_TEXT;

impl Script {
    pub fn from_json(text: &str) -> Result<Script, String> {
        serde_json::from_str(text).map_err(|e| format!("test script: {e}"))
    }

    /// The forced output for a rendered prompt, if a rule matches.
    pub fn output_for(&self, prompt: &str) -> Option<&str> {
        let tail = prompt.rfind(USER).map_or(prompt, |i| &prompt[i..]);
        self.rules
            .iter()
            .find(|r| tail.contains(&r.when))
            .map(|r| r.output.as_str())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matches_last_user_turn_only() {
        let s =
            Script::from_json(r#"[{"when":"weather","output":"sunny"},{"when":"","output":"x"}]"#)
                .unwrap();
        assert_eq!(
            s.output_for("<｜User｜>what weather?<｜Assistant｜>"),
            Some("sunny")
        );
        assert_eq!(
            s.output_for("<｜User｜>weather<｜Assistant｜>a<｜User｜>hi<｜Assistant｜>"),
            Some("x")
        );
        assert!(Script::from_json("{").is_err());
    }
}
