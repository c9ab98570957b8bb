/**
 * What `bot.when()` matches on.
 *
 * @module
 */
import type { InboundMessage, MessageType } from "./provider.ts";

/** Matches messages of one type (`IMAGE`, `TEXT`, …) or every message (`ANY`). */
export interface TypeMatcher {
  readonly messageType: MessageType | "*";
}

/**
 * A matcher: a string (the whole text, trimmed, case-insensitive), a RegExp
 * (tested against the text), a predicate, a type constant, or a list of these
 * (any of them).
 */
export type Matcher =
  | string
  | RegExp
  | TypeMatcher
  | ((message: InboundMessage) => boolean)
  | readonly Matcher[];

function typeMatcher(messageType: MessageType | "*"): TypeMatcher {
  return Object.freeze({ messageType });
}

/** Text messages. */
export const TEXT: TypeMatcher = typeMatcher("text");
/** Image messages. */
export const IMAGE: TypeMatcher = typeMatcher("image");
/** Audio and voice messages. */
export const AUDIO: TypeMatcher = typeMatcher("audio");
/** Video messages. */
export const VIDEO: TypeMatcher = typeMatcher("video");
/** Documents (files). */
export const DOCUMENT: TypeMatcher = typeMatcher("document");
/** Button presses, list choices and other interactions. */
export const INTERACTION: TypeMatcher = typeMatcher("interaction");
/** Every message. */
export const ANY: TypeMatcher = typeMatcher("*");

/**
 * Check a matcher's shape.
 *
 * @param matcher the matcher
 * @throws {TypeError} when it is not a matcher
 */
export function assertMatcher(matcher: unknown, path = "matcher"): asserts matcher is Matcher {
  if (typeof matcher === "string" || matcher instanceof RegExp || typeof matcher === "function") return;
  if (Array.isArray(matcher)) {
    matcher.forEach((m, i) => assertMatcher(m, `${path}[${i}]`));
    return;
  }
  if (typeof matcher === "object" && matcher !== null && typeof (matcher as TypeMatcher).messageType === "string") return;
  throw new TypeError(
    `Argument "${path}" must be a string, RegExp, predicate, type constant (TEXT, IMAGE, …) or an array of these, got ${
      JSON.stringify(matcher) ?? typeof matcher
    }`,
  );
}

/**
 * Whether `message` matches.
 *
 * @param matcher the matcher
 * @param message the inbound message
 * @returns whether it matches
 */
export function matches(matcher: Matcher, message: InboundMessage): boolean {
  if (typeof matcher === "string") {
    return message.text !== undefined && message.text.trim().toLowerCase() === matcher.trim().toLowerCase();
  }
  if (matcher instanceof RegExp) {
    if (message.text === undefined) return false;
    matcher.lastIndex = 0;
    return matcher.test(message.text);
  }
  if (typeof matcher === "function") return matcher(message);
  if (Array.isArray(matcher)) return matcher.some((m) => matches(m, message));
  const type = (matcher as TypeMatcher).messageType;
  return type === "*" || type === message.type;
}
