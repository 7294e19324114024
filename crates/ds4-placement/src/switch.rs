//! The one reader of on/off settings every ds4 crate uses (`DS4_WARMUP`, `DS4_QUALITY`,
//! the placement aliases, ...): the same words mean the same thing in every variable, and
//! a value that is neither is an error naming the variable, so a typo never silently
//! measures or runs the default.

use crate::request::{OverrideError, Setting, Source};

/// What [`parse_switch`] accepts, for error messages and docs.
pub const SWITCH_WORDS: &str = "1/on/true/yes or 0/off/false/no";

/// `value` of the switch `name` as a bool: `1`, `on`, `true`, `yes` are on; `0`, `off`,
/// `false`, `no` are off (trimmed, any case); anything else is an error.
pub fn parse_switch(name: &str, value: &str) -> Result<bool, OverrideError> {
    match value.trim().to_ascii_lowercase().as_str() {
        "1" | "on" | "true" | "yes" => Ok(true),
        "0" | "off" | "false" | "no" => Ok(false),
        _ => Err(OverrideError::BadValue {
            name: name.to_string(),
            value: value.to_string(),
            expected: SWITCH_WORDS,
        }),
    }
}

/// A switch from its flag and its variable: a flag given on the command line (`flag`:
/// its name and the value it sets) wins over the variable `var` (looked up by `env`),
/// which wins over `default`. The variable is parsed even when the flag wins, so a typo
/// in it is reported either way.
pub fn resolve_switch(
    flag: Option<(&str, bool)>,
    var: &str,
    default: bool,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Setting<bool>, OverrideError> {
    let from_env = match env(var) {
        Some(v) => Some(Setting::new(
            parse_switch(var, &v)?,
            Source::Env {
                var: var.to_string(),
                value: v,
            },
        )),
        None => None,
    };
    let from_flag = flag.map(|(name, on)| {
        Setting::new(
            on,
            Source::Cli {
                flag: name.to_string(),
                value: String::new(),
            },
        )
    });
    Ok(from_flag
        .or(from_env)
        .unwrap_or(Setting::new(default, Source::Default)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_word_reads_the_same_in_every_variable() {
        for on in ["1", "on", " ON ", "true", "Yes"] {
            assert!(parse_switch("SOME_SWITCH", on).unwrap(), "{on:?}");
        }
        for off in ["0", "off", " OFF ", "false", "no", "No"] {
            assert!(!parse_switch("SOME_SWITCH", off).unwrap(), "{off:?}");
        }
        for bad in ["", "2", "of", "maybe"] {
            let e = parse_switch("SOME_SWITCH", bad).unwrap_err().to_string();
            assert!(
                e.contains("SOME_SWITCH") && e.contains(SWITCH_WORDS),
                "{bad:?}: {e}"
            );
        }
    }

    #[test]
    fn flag_beats_variable_beats_default_and_a_bad_variable_is_reported() {
        let env = |v: Option<&'static str>| move |_: &str| v.map(String::from);
        let s = resolve_switch(None, "SOME_SWITCH", true, &env(None)).unwrap();
        assert!(s.value && s.source.is_default());
        let s = resolve_switch(None, "SOME_SWITCH", true, &env(Some("no"))).unwrap();
        assert!(!s.value);
        assert_eq!(s.source.to_string(), "SOME_SWITCH=no");
        let s = resolve_switch(Some(("--x", true)), "SOME_SWITCH", false, &env(Some("0"))).unwrap();
        assert!(s.value);
        assert_eq!(s.source.to_string(), "--x");
        assert!(
            resolve_switch(Some(("--x", true)), "SOME_SWITCH", false, &env(Some("?"))).is_err()
        );
    }
}
