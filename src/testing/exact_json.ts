/**
 * Exact JSON for the hostile-input tests of the conformance suite: JSON whose
 * own keys an assignment would not create (`__proto__`), and a check that a
 * value is that JSON key for key, on plain objects.
 *
 * @module
 */
import type { JsonValue } from "../contract.ts";
import type { ConformanceHarness } from "./conformance.ts";

type Expect = ConformanceHarness["expect"];

/**
 * JSON with own keys that an assignment on a plain object would not create
 * (`__proto__` sets the prototype instead), nested, next to `constructor`,
 * `prototype` and a string cut in the middle of an emoji (a lone surrogate,
 * which JSON text escapes): every backend must store and return it exactly.
 */
export function hostile(): JsonValue {
  return JSON.parse(
    '{"__proto__": {"polluted": true, "__proto__": {"deep": [1, {"__proto__": "s"}]}}, ' +
      '"constructor": {"prototype": {"polluted": 1}, "name": "Object"}, "prototype": 2, ' +
      '"toString": "not a function", "hasOwnProperty": null, "list": [{"__proto__": []}, {"constructor": null}], ' +
      '"cut": "emoji \\ud83d", "$bytes": "not binary"}',
  ) as JsonValue;
}

/**
 * Expects `actual` to be exactly the JSON `expected`: the same text, and at
 * every level the same own keys in the same order, on plain objects (the
 * prototype `Object.prototype`, never a stored `__proto__`).
 */
export function expectExactJson(expect: Expect, actual: unknown, expected: JsonValue, what: string): void {
  expect(JSON.stringify(actual), `${what}: the JSON text`).toBe(JSON.stringify(expected));
  const walk = (a: unknown, e: JsonValue, at: string): void => {
    if (typeof e !== "object" || e === null) {
      expect(a, `${what}: ${at}`).toBe(e);
      return;
    }
    expect(typeof a === "object" && a !== null, `${what}: ${at} is an object or array`).toBe(true);
    if (Array.isArray(e)) {
      expect(Array.isArray(a), `${what}: ${at} is an array`).toBe(true);
      const list = a as unknown[];
      expect(list.length, `${what}: ${at}.length`).toBe(e.length);
      e.forEach((item, i) => walk(list[i], item, `${at}[${i}]`));
      return;
    }
    expect(Object.getPrototypeOf(a) === Object.prototype, `${what}: ${at} is a plain object`).toBe(true);
    expect(Object.keys(a as object), `${what}: the own keys of ${at}`).toEqual(Object.keys(e));
    for (const key of Object.keys(e)) {
      const own = Object.getOwnPropertyDescriptor(a, key);
      expect(own !== undefined && "value" in own, `${what}: ${at}.${key} is an own data property`).toBe(true);
      walk(own?.value, Object.getOwnPropertyDescriptor(e, key)!.value as JsonValue, `${at}.${key}`);
    }
  };
  walk(actual, expected, "value");
}

