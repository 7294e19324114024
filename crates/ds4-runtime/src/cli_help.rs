//! A check the binaries' tests share: every argument a user can pass is explained by
//! `--help` (flags and positionals, in every subcommand).

/// The arguments of `cmd` and of its subcommands that have no help text, as
/// "command subcommand argument" paths (hidden arguments, `--help` and `--version` aside).
pub fn undocumented_arguments(cmd: &clap::Command) -> Vec<String> {
    let mut out = Vec::new();
    walk(cmd, cmd.get_name(), &mut out);
    out
}

fn walk(cmd: &clap::Command, path: &str, out: &mut Vec<String>) {
    for a in cmd.get_arguments() {
        let id = a.get_id().as_str();
        if a.is_hide_set() || id == "help" || id == "version" {
            continue;
        }
        if a.get_help().is_none_or(|h| h.to_string().trim().is_empty()) {
            out.push(format!("{path} {id}"));
        }
    }
    for sc in cmd.get_subcommands() {
        walk(sc, &format!("{path} {}", sc.get_name()), out);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn arguments_without_help_are_named_with_their_subcommand() {
        let cmd = clap::Command::new("t")
            .arg(clap::Arg::new("kept").long("kept").help("explained"))
            .arg(clap::Arg::new("bare").long("bare"))
            .subcommand(clap::Command::new("sub").arg(clap::Arg::new("file")));
        assert_eq!(undocumented_arguments(&cmd), ["t bare", "t sub file"]);
    }
}
