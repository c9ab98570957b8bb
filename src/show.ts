/**
 * How error messages quote a value the caller gave.
 *
 * @module
 */

/**
 * A short, readable rendering of `value` for an error message: strings
 * quoted, BigInts with their `n`, plain objects and arrays as JSON, class
 * instances by class name (`an instance of Date`), anything long cut at
 * 120 characters.
 *
 * @param value what the caller passed
 * @returns the text to quote
 */
export function showValue(value: unknown): string {
  switch (typeof value) {
    case "string":
      return JSON.stringify(value);
    case "bigint":
      return `${value}n`;
    case "function":
      return "a function";
    case "symbol":
      return "a symbol";
    case "object": {
      if (value === null) return "null";
      const proto = Object.getPrototypeOf(value);
      if (!Array.isArray(value) && proto !== Object.prototype && proto !== null) {
        return `an instance of ${(value as { constructor?: { name?: string } }).constructor?.name || "a class"}`;
      }
      try {
        const json = JSON.stringify(value) ?? String(value);
        return json.length > 120 ? `${json.slice(0, 119)}…` : json;
      } catch {
        return Array.isArray(value) ? "an array" : "an object";
      }
    }
    default:
      return String(value);
  }
}
