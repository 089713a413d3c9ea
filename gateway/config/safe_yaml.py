"""The YAML reader for config files: plain data only, no duplicate keys, bounded aliases.

Trusts nothing in the text. It builds no Python objects beyond dicts, lists and
scalars (yaml.SafeLoader), and it refuses a document whose aliases would expand it
past a fixed size before anything walks the expanded tree.
"""

from __future__ import annotations

from typing import Any

import yaml

# Values that aliases (`*name`, `<<: *name`) may add to a document in all, counting each
# use of an alias as a copy of what it names. Sharing one defaults block among a thousand
# routes adds ~10,000; nine nested lists of nine aliases (a 300-byte "billion laughs")
# add 387 million, which the interpolation walk would copy value by value.
MAX_ALIAS_EXPANSION = 100_000


class SafeLoader(yaml.SafeLoader):
    """yaml.safe_load's loader, except that a key given twice in one mapping is an
    error (plain YAML keeps the last one silently, so a second `per_client` under
    `limits` would replace the first without a word), and so is a document that its
    aliases expand past MAX_ALIAS_EXPANSION values."""

    def compose_document(self) -> yaml.Node | None:
        node = super().compose_document()
        if node is None:  # an empty document
            return None
        added = _expanded_size(node, {}) - _distinct_size(node, set())
        if added > MAX_ALIAS_EXPANSION:
            raise yaml.composer.ComposerError(
                problem=f"aliases expand the document by more than {MAX_ALIAS_EXPANSION:,} values (an alias bomb?)"
            )
        return node

    def construct_yaml_int(self, node: yaml.ScalarNode) -> int:
        try:
            return super().construct_yaml_int(node)
        except ValueError:
            # Python refuses to read an int of more than 4,300 digits (CVE-2020-10735).
            raise yaml.constructor.ConstructorError(
                None, None, "an integer with more digits than any config value can hold", node.start_mark
            ) from None

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, yaml.MappingNode):
            seen: set[Any] = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` may be overridden by the keys beside it
                key = self.construct_object(key_node, deep=deep)
                try:
                    duplicate = key in seen
                    seen.add(key)
                except TypeError:
                    continue  # unhashable: the base class reports it
                if duplicate:
                    raise yaml.constructor.ConstructorError(
                        "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                    )
        return super().construct_mapping(node, deep=deep)


SafeLoader.add_constructor("tag:yaml.org,2002:int", SafeLoader.construct_yaml_int)


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.SequenceNode):
        return node.value
    if isinstance(node, yaml.MappingNode):
        return [child for pair in node.value for child in pair]
    return []


def _expanded_size(node: yaml.Node, sizes: dict[int, int]) -> int:
    """Nodes in the tree with every alias copied out, each shared node counted once per use
    (memoised, so the work is linear in the composed graph, not in its expansion)."""
    key = id(node)
    if key in sizes:
        if sizes[key] < 0:
            # A node inside its own anchor expands without end.
            raise yaml.composer.ComposerError(problem="an alias is used inside the anchor it names")
        return sizes[key]
    sizes[key] = -1
    sizes[key] = 1 + sum(_expanded_size(child, sizes) for child in _children(node))
    return sizes[key]


def _distinct_size(node: yaml.Node, seen: set[int]) -> int:
    if id(node) in seen:
        return 0
    seen.add(id(node))
    return 1 + sum(_distinct_size(child, seen) for child in _children(node))


def load(text: str) -> Any:
    """The one document in `text`; raises yaml.YAMLError (or RecursionError when nested too deeply)."""
    return yaml.load(text, Loader=SafeLoader)
