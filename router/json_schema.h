/* response_format and the regex extension compiled to grammar text (engine/grammar.h) on the router, which ships
 * the text to the nodes (issue 23 item 3). The router does it because it already parses the request's JSON (cJSON
 * lives in baton_common, not in the engine), so an unsupported keyword is a 400 before any node works, and one
 * wire field (the grammar) carries every kind of constraint.
 *
 * Supported JSON Schema: type (one or a list) object/array/string/number/integer/boolean/null; properties in
 * schema order with required (optional ones may be left out; no other property is ever generated, which every
 * additionalProperties accepts), additionalProperties as a schema for objects without properties; items,
 * prefixItems, minItems/maxItems; minLength/maxLength, pattern (a regex subset, matched whole: a superset of what
 * the unanchored pattern accepts is never produced), both together (the pattern's automaton crossed with a length
 * counter; BT_ERR_UNSUPPORTED past 4,096 automaton states or 20,000 state-length pairs), format
 * date/time/date-time/uuid/ipv4/email; integer minimum/maximum/exclusiveMinimum/exclusiveMaximum exactly (digit
 * ranges); number bounds of any sign, integer or not, exclusive or not, exactly, for bounds of at most 15
 * significant digits (numbers are then written without exponent with at most 15 significant digits, so the decimal
 * comparison the grammar makes is the one a validator makes on doubles); enum, const, anyOf, oneOf when its branches
 * are provably exclusive (different JSON types, disjoint const/enum values, or objects with a required property
 * whose schemas are exclusive: a discriminator; otherwise BT_ERR_UNSUPPORTED naming oneOf, since the grammar cannot
 * rule out a value that matches two branches), allOf of one schema, $ref to #, #/$defs/NAME or #/definitions/NAME
 * (recursion allowed), and the
 * annotations (title, description, default, examples, $schema, $id, $comment, deprecated, readOnly, writeOnly).
 * Anything else is BT_ERR_UNSUPPORTED with a message naming the keyword; malformed schemas are BT_ERR_INVALID.
 * Every output the grammar allows validates against the schema. */
#ifndef BATON_ROUTER_JSON_SCHEMA_H
#define BATON_ROUTER_JSON_SCHEMA_H

#include <cjson/cJSON.h>
#include <stddef.h>

#include "common/status.h"

#define RTR_SCHEMA_MAX_GRAMMAR (256u << 10) /* bytes of generated grammar */

/* Grammar text for `schema` into a malloc'd NUL-terminated *out (caller frees). Errors as above; BT_ERR_NOMEM. */
bt_status rtr_json_schema_grammar(const cJSON *schema, char **out);

/* Rules for several schemas in one grammar, for a caller that writes its own `root` (tool calls wrap each tool's
 * parameters in the call syntax): rule "<prefix><i>" matches schemas[i], whose $ref "#..." resolve inside
 * schemas[i]; the shared JSON rules (ws, jstr, jval, ...) come with them. prefix must not clash with those names or
 * with s<digits>. compact: at most one space between JSON tokens (the spacing models write in tool calls; a small
 * model given up to four whitespace characters at every gap spends its tokens on them). Errors as
 * rtr_json_schema_grammar (a left-recursive $ref cycle is found only when the caller's grammar is parsed);
 * BT_ERR_NOMEM. */
bt_status rtr_json_schema_rules(const cJSON *const *schemas, size_t n, const char *prefix, int compact, char **out);

/* Grammar text for any JSON object (response_format json_object). BT_ERR_NOMEM. */
bt_status rtr_json_object_grammar(char **out);

/* Grammar text for text matching the regex `re` whole (the regex extension). Supported: literals and escapes,
 * . [...] [^...] \d \w \s \D \W \S, groups (...) (?:...), |, * + ? {m} {m,} {m,n} (lazy forms as greedy), ^ and $ at
 * the ends. Back-references, lookaround and \b are BT_ERR_UNSUPPORTED naming them; syntax errors BT_ERR_INVALID. */
bt_status rtr_regex_grammar(const char *re, char **out);

#endif
