// `nanreplay completion bash|zsh|fish`: a completion script for the shell.
// Command names come from the command table; each command's flags are asked
// of `nanreplay CMD --help` when completing, so the script never goes stale.
#include <algorithm>
#include <string>

#include <nlohmann/json.hpp>

#include "cli/command_table.h"
#include "loaders/base/error.h"

namespace nanreplay {

namespace {

constexpr const char* kCompletionHelp =
    "Print a shell completion script for nanreplay's commands and their flags.\n\n"
    "usage: nanreplay completion bash|zsh|fish [--json]\n\n"
    "--json prints {\"shell\": ..., \"script\": ...} instead of the bare script.\n\n"
    "Example: source <(nanreplay completion bash)            # in ~/.bashrc\n"
    "         nanreplay completion zsh > \"${fpath[1]}/_nanreplay\"\n"
    "         nanreplay completion fish > ~/.config/fish/completions/nanreplay.fish\n";

std::string command_names() {
  std::string names;
  for (const Command& c : command_table()) names += (names.empty() ? "" : " ") + std::string(c.name);
  return names;
}

// Flags are read off `nanreplay CMD --help` (every --word it mentions).
constexpr const char* kFlagsOf = "nanreplay \"$1\" --help 2>/dev/null | grep -o -- '--[a-z][a-z0-9-]*' | sort -u";

std::string bash_script() {
  return "# nanreplay completion for bash: source <(nanreplay completion bash)\n"
         "_nanreplay_flags() { " + std::string(kFlagsOf) + "; }\n"
         "_nanreplay() {\n"
         "  local cur=\"${COMP_WORDS[COMP_CWORD]}\"\n"
         "  if [[ $COMP_CWORD -eq 1 ]]; then\n"
         "    COMPREPLY=($(compgen -W \"" + command_names() + " help\" -- \"$cur\"))\n"
         "  elif [[ \"$cur\" == -* ]]; then\n"
         "    COMPREPLY=($(compgen -W \"$(_nanreplay_flags \"${COMP_WORDS[1]}\")\" -- \"$cur\"))\n"
         "  else\n"
         "    COMPREPLY=($(compgen -f -- \"$cur\"))\n"
         "  fi\n"
         "}\n"
         "complete -o filenames -F _nanreplay nanreplay\n";
}

std::string zsh_script() {
  return "#compdef nanreplay\n"
         "# nanreplay completion for zsh: nanreplay completion zsh > \"${fpath[1]}/_nanreplay\"\n"
         "_nanreplay_flags() { " + std::string(kFlagsOf) + "; }\n"
         "_nanreplay() {\n"
         "  if (( CURRENT == 2 )); then\n"
         "    compadd -- " + command_names() + " help\n"
         "  elif [[ $words[CURRENT] == -* ]]; then\n"
         "    compadd -- $(_nanreplay_flags $words[2])\n"
         "  else\n"
         "    _files\n"
         "  fi\n"
         "}\n"
         "compdef _nanreplay nanreplay\n";
}

std::string fish_script() {
  std::string out = "# nanreplay completion for fish: nanreplay completion fish > ~/.config/fish/completions/nanreplay.fish\n"
                    "function __nanreplay_flags\n"
                    "  nanreplay (commandline -opc)[2] --help 2>/dev/null | string match -r -a -- '--[a-z][a-z0-9-]*' | "
                    "sort -u\n"
                    "end\n";
  for (const Command& c : command_table()) {
    std::string summary = std::string(c.summary).substr(0, 60);
    for (size_t at = summary.find('\''); at != std::string::npos; at = summary.find('\'', at + 2)) {
      summary.replace(at, 1, "\\'");
    }
    out += "complete -c nanreplay -n __fish_use_subcommand -f -a " + std::string(c.name) + " -d '" + summary + "'\n";
  }
  out += "complete -c nanreplay -n 'not __fish_use_subcommand' -a '(__nanreplay_flags)'\n";
  return out;
}

}  // namespace

int completion_command(const CommandArgs& args, CommandIo& io) {
  if (args.size() > 1 && (args[1] == "--help" || args[1] == "-h")) {
    io.out << kCompletionHelp << exit_status_help("completion");
    return 0;
  }
  CommandArgs words(args.begin() + 1, args.end());
  const bool json = std::find(words.begin(), words.end(), "--json") != words.end();
  words.erase(std::remove(words.begin(), words.end(), "--json"), words.end());
  const std::string shell = words.size() == 1 ? words[0] : "";
  std::string script;
  if (shell == "bash") {
    script = bash_script();
  } else if (shell == "zsh") {
    script = zsh_script();
  } else if (shell == "fish") {
    script = fish_script();
  } else {
    throw UsageError("completion: expected one shell, bash, zsh or fish (see nanreplay completion --help)");
  }
  io.out << (json ? nlohmann::json{{"shell", shell}, {"script", script}}.dump(2) + "\n" : script);
  return 0;
}

}  // namespace nanreplay
