/**
 * Checks on values from outside (JSON from Meta), and short quotes of them
 * for error messages.
 *
 * @module
 */
import { showValue as show } from "../../src/show.ts";

/** Whether a value is a plain object (not `null`, not an array). */
export function isObject(value: unknown): value is Record<string, unknown> {
  return typeof value === "object" && value !== null && !Array.isArray(value);
}

/** `show(value)`, cut to 200 characters. */
export function brief(value: unknown): string {
  const text = show(value);
  return text.length > 200 ? `${text.slice(0, 200)}…` : text;
}

/** A body quoted for an error message, cut to 200 characters. */
export function snippet(text: string): string {
  return text === "" ? "an empty body" : show(text.length > 200 ? `${text.slice(0, 200)}…` : text);
}
