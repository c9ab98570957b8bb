/**
 * Telegram's default rate limits made `factor` times faster, for tests that
 * must not wait a second per message (the shape and the chat rules are kept).
 */
import type { Rate, RateLimitOptions } from "../../src/rate_limit.ts";
import { TELEGRAM_RATE_LIMITS } from "../../providers/telegram/mod.ts";

/** `rate` allowing `factor` times as many sends in the same time (rounded down, at least 1). */
export function scaleRate(rate: Rate, factor: number): Rate {
  return { ...rate, count: Math.max(1, Math.floor(rate.count * factor)) };
}

/**
 * Telegram's limits at `factor` times their rate, as a `durability.outbox.rateLimit` option
 * (`factor` 8: 80% of the fake's limits at 10x, the margin a bot leaves for network jitter).
 */
export function scaledTelegramLimits(factor: number): RateLimitOptions {
  const perChat = TELEGRAM_RATE_LIMITS.perChat as (chatId: string) => Rate | undefined;
  return {
    global: scaleRate(TELEGRAM_RATE_LIMITS.global!, factor),
    perChat: (chatId) => {
      const rate = perChat(chatId);
      return rate === undefined ? undefined : scaleRate(rate, factor);
    },
  };
}
