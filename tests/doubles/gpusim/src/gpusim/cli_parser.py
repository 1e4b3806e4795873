"""SGLang's launch-flag parser, rebuilt per version from the bundled argparse dumps.

The parser is a real ``argparse.ArgumentParser`` so that usage text, exit status 2,
prefix abbreviations, ambiguity errors and type errors come from argparse itself,
exactly as they do in SGLang.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from decimal import Decimal
from functools import cache
from importlib import resources
from typing import Any

from gpusim.versions import Version

# v9 stores the parallel sizes under their long spelling and copies them in from_cli_args.
V9_DEST_RENAMES = {
    "tensor_parallel_size": "tp_size",
    "pipeline_parallel_size": "pp_size",
    "attention_context_parallel_size": "attn_cp_size",
    "moe_data_parallel_size": "moe_dp_size",
    "data_parallel_size": "dp_size",
    "expert_parallel_size": "ep_size",
}


@cache
def load_flags(table: str) -> dict[str, dict[str, Any]]:
    text = resources.files("gpusim").joinpath("flags").joinpath(f"{table}.json").read_text(encoding="utf-8")
    return json.loads(text)


@cache
def _order() -> dict[str, Any]:
    text = resources.files("gpusim").joinpath("flags").joinpath("order.json").read_text(encoding="utf-8")
    return json.loads(text)


def field_order(version: Version) -> list[str]:
    """ServerArgs field order (the dataclass repr order) for this version."""
    order = _order()
    if version.family < 14:
        return list(order["0.5.9"]["fields"])
    return list(order["0.5.23"]["fields"])


def _sorted_entries(version: Version, flags: dict[str, dict[str, Any]]) -> list[dict[str, Any]]:
    order = _order()
    v9_opts = {name: i for i, name in enumerate(order["0.5.9"]["options"])}
    v23_fields = {name: i for i, name in enumerate(order["0.5.23"]["fields"])}
    big = 10**6
    keyed = []
    for pos, (key, entry) in enumerate(flags.items()):
        if version.family < 14:
            rank: tuple[int, int] = (v9_opts.get(key, big), pos)
        else:
            dest = entry["dest"]
            if entry["action"].startswith("Deprecated") and dest in v23_fields:
                rank = (big - 1, pos)
            elif dest in v23_fields:
                rank = (v23_fields[dest], pos)
            elif key in v9_opts:
                rank = (big // 2 + v9_opts[key], pos)
            else:
                rank = (big, pos)
        keyed.append((rank, entry))
    keyed.sort(key=lambda item: item[0])
    return [entry for _, entry in keyed]


# --- custom argparse types, named as in SGLang so argparse's messages match -------------


def human_readable_int(value: str) -> int:
    value = value.strip()
    si = {"k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}
    iec = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40}
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)", value)
    if m:
        number, suffix = m.groups()
        if suffix in iec:
            if "." in number:
                raise argparse.ArgumentTypeError(
                    f"Decimals are not allowed with IEC suffixes like '{suffix}'. "
                    f"Use an integer IEC value such as '{int(Decimal(number))}{suffix}', "
                    f"or an SI value such as '{number}{suffix[0]}'."
                )
            return int(number) * iec[suffix]
        return int(Decimal(number) * si[suffix])
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"Invalid integer value: '{value}'. "
            "Use a plain integer, SI suffixes (1k, 1M), or IEC suffixes (1Ki, 1Mi). "
            "Suffixes are case-sensitive."
        ) from None


def json_list_type(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError:
        raise argparse.ArgumentTypeError(f"Invalid JSON list: {value}. Please provide a valid JSON list.") from None


def loads(value: str) -> Any:
    return json.loads(value)


def nullable_str(val: str) -> str | None:
    if not val or val == "None":
        return None
    return val


def parse_cuda_graph_backend_arg(raw: str) -> str:
    if raw == "tc_piecewise":
        raise argparse.ArgumentTypeError("tc_piecewise was removed; select breakable, full, or disabled")
    return raw


_CG_PHASES = ("decode", "prefill")


def parse_cuda_graph_config_arg(raw: str) -> dict[str, dict[str, Any]]:
    try:
        parsed = json.loads(raw)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"--cuda-graph-config must be JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"--cuda-graph-config must be a JSON object, got {type(parsed).__name__}")
    result: dict[str, dict[str, Any]] = {}
    for raw_phase, settings in parsed.items():
        phase = str(raw_phase)
        if phase not in _CG_PHASES:
            raise argparse.ArgumentTypeError(
                f"--cuda-graph-config: unknown phase '{phase}', expected one of {list(_CG_PHASES)}"
            )
        if not isinstance(settings, dict):
            raise argparse.ArgumentTypeError(
                f"--cuda-graph-config['{phase}'] must be a JSON object, got {type(settings).__name__}"
            )
        if "backend" in settings:
            parse_cuda_graph_backend_arg(settings["backend"])
        result[phase] = dict(settings)
    return result


_TYPES: dict[str, Any] = {
    "int": int,
    "float": float,
    "str": str,
    "human_readable_int": human_readable_int,
    "json_list_type": json_list_type,
    "loads": loads,
    "nullable_str": nullable_str,
    "parse_cuda_graph_backend_arg": parse_cuda_graph_backend_arg,
    "parse_cuda_graph_config_arg": parse_cuda_graph_config_arg,
}


# --- actions --------------------------------------------------------------------


def print_deprecated_warning(message: str) -> None:
    # SGLang logs this before logging is configured, so Python's last-resort handler
    # writes the bare message to stderr.
    sys.stderr.write(f"\033[1;33m{message}\033[0m\n")
    sys.stderr.flush()


class LoRAPathAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None):
        lora_paths: list[Any] = []
        if values:
            for raw_path in values:
                lora_path = raw_path.strip()
                if lora_path.startswith("{") and lora_path.endswith("}"):
                    obj = json.loads(lora_path)
                    if "lora_path" not in obj or "lora_name" not in obj:
                        raise AssertionError(
                            f"{lora_path!r} looks like a JSON str, "
                            "but it does not contain 'lora_name' and 'lora_path' keys."
                        )
                    lora_paths.append(obj)
                else:
                    lora_paths.append(lora_path)
        setattr(namespace, self.dest, lora_paths)


class DeprecatedAction(argparse.Action):
    def __init__(self, option_strings, dest, nargs=0, **kwargs):
        super().__init__(option_strings, dest, nargs=nargs, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        print_deprecated_warning(
            f"The command line argument '{option_string}' is deprecated and will be removed in future versions."
        )


class DeprecatedStoreTrueAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, nargs=0, const=True, default=False, **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, nargs=nargs, const=const, default=default, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        replacement = f" Use '{self.new_flag}' instead." if self.new_flag else ""
        print_deprecated_warning(
            f"'{option_string}' is deprecated and will be removed in a future release.{replacement}"
        )
        setattr(namespace, self.dest, True)


class DeprecatedStoreConstAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, const_value=None, nargs=0, default=None, **kwargs):
        self.new_flag = new_flag
        self.const_value = const_value
        super().__init__(option_strings, dest, nargs=nargs, default=default, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        replacement = f" Use '{self.new_flag}' instead." if self.new_flag else ""
        print_deprecated_warning(
            f"'{option_string}' is deprecated and will be removed in a future release.{replacement}"
        )
        setattr(namespace, self.dest, self.const_value)


class DeprecatedAliasStoreAction(argparse.Action):
    def __init__(self, option_strings, dest, new_flag=None, **kwargs):
        self.new_flag = new_flag
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None):
        replacement = f" Use '{self.new_flag}' instead." if self.new_flag else ""
        print_deprecated_warning(
            f"'{option_string}' is deprecated and will be removed in a future release.{replacement}"
        )
        setattr(namespace, self.dest, values)


def _const_value_for(entry: dict[str, Any]) -> Any:
    target = entry.get("deprecated_for") or ""
    if "=" in target:
        return target.split("=", 1)[1]
    return True


def _add(parser: argparse.ArgumentParser, entry: dict[str, Any]) -> None:
    opts = list(entry["option_strings"])
    action = entry["action"]
    default = argparse.SUPPRESS if entry["default"] == "==SUPPRESS==" else entry["default"]
    kw: dict[str, Any] = {"dest": entry["dest"], "default": default}
    type_fn = _TYPES.get(entry["type"]) if entry["type"] else None
    if entry["type"] and type_fn is None:
        raise RuntimeError(f"no converter for argparse type {entry['type']!r}")
    if action == "_StoreTrueAction":
        kw["action"] = "store_true"
    elif action == "_StoreFalseAction":
        kw["action"] = "store_false"
    elif action == "_StoreConstAction":
        kw.update(action="store_const", const=entry["const"])
    elif action == "_AppendAction":
        kw.update(action="append", type=type_fn, nargs=entry["nargs"], choices=entry["choices"])
    elif action == "BooleanOptionalAction":
        positive = [o for o in opts if not any(o == "--no-" + p[2:] for p in opts if p != o)]
        opts = positive
        kw["action"] = argparse.BooleanOptionalAction
    elif action == "LoRAPathAction":
        kw.update(action=LoRAPathAction, type=type_fn, nargs=entry["nargs"])
    elif action == "DeprecatedAction":
        kw["action"] = DeprecatedAction
    elif action == "DeprecatedStoreTrueAction":
        kw.update(action=DeprecatedStoreTrueAction, new_flag=entry.get("deprecated_for"))
    elif action == "DeprecatedStoreConstAction":
        kw.update(
            action=DeprecatedStoreConstAction,
            new_flag=entry.get("deprecated_for"),
            const_value=_const_value_for(entry),
            nargs=entry["nargs"],
        )
        if entry["choices"]:
            kw["choices"] = entry["choices"]
    elif action == "DeprecatedAliasStoreAction":
        kw.update(
            action=DeprecatedAliasStoreAction,
            new_flag=entry.get("deprecated_for"),
            type=type_fn,
            nargs=entry["nargs"],
            choices=entry["choices"],
        )
    elif action == "_StoreAction":
        kw.update(type=type_fn, choices=entry["choices"])
        if entry["nargs"] is not None:
            kw["nargs"] = entry["nargs"]
        if entry["const"] is not None:
            kw["const"] = entry["const"]
    else:
        raise RuntimeError(f"unsupported argparse action {action!r}")
    if entry["dest"] == "model_path":
        kw["required"] = True
    parser.add_argument(*opts, **kw)


def build_parser(version: Version) -> argparse.ArgumentParser:
    prog = "sglang serve" if version.prog_is_sglang_serve else None
    parser = argparse.ArgumentParser(prog=prog)
    flags = load_flags(version.flags_table)
    for entry in _sorted_entries(version, flags):
        _add(parser, entry)
    return parser


def _config_file_args(parser: argparse.ArgumentParser, argv: list[str]) -> list[str]:
    """--config FILE: YAML (or JSON) keys become flags placed before the command line."""
    idx = argv.index("--config")
    if idx + 1 >= len(argv):
        return argv
    path = argv[idx + 1]
    rest = argv[:idx] + argv[idx + 2 :]
    with open(path, encoding="utf-8") as fh:
        text = fh.read()
    try:
        import yaml  # noqa: PLC0415  (optional dependency)

        data = yaml.safe_load(text) or {}
    except ImportError:
        data = json.loads(text or "{}")
    store_true = {a.dest for a in parser._actions if isinstance(a, argparse._StoreTrueAction)}
    extra: list[str] = []
    for key, value in dict(data).items():
        flag = "--" + str(key).replace("_", "-")
        if str(key).replace("-", "_") in store_true:
            if value:
                extra.append(flag)
        elif isinstance(value, list):
            extra.append(flag)
            extra.extend(str(v) for v in value)
        elif isinstance(value, dict):
            extra.extend([flag, json.dumps(value)])
        else:
            extra.extend([flag, str(value)])
    return extra + rest


def parse_args(argv: list[str], version: Version) -> dict[str, Any]:
    """Parse like ``prepare_server_args``; argparse exits with status 2 on error."""
    parser = build_parser(version)
    if "--config" in argv:
        argv = _config_file_args(parser, list(argv))
    ns = parser.parse_args(argv)
    values = vars(ns)
    if version.family < 14:
        for old, new in V9_DEST_RENAMES.items():
            if old in values:
                values[new] = values.pop(old)
    return values
