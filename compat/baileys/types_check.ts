// Compile-time check (tsc -p compat/baileys): the real baileys types fit the provider's structural ones.
import { makeWASocket, type WAMessage, type BaileysEventMap, proto } from "baileys";
import type { BaileysSocketLike, BaileysUpsert, BaileysMessageUpdate, BaileysReceiptUpdate, BaileysWAMessage } from "../../providers/baileys/socket.ts";
import { BaileysProvider } from "../../providers/baileys/provider.ts";
declare const sock: ReturnType<typeof makeWASocket>;
const like: BaileysSocketLike = sock;
new BaileysProvider({ socket: sock });
declare const upsert: BaileysEventMap["messages.upsert"];
const u: BaileysUpsert = upsert;
declare const update: BaileysEventMap["messages.update"];
const mu: BaileysMessageUpdate[] = update;
declare const receipt: BaileysEventMap["message-receipt.update"];
const r: BaileysReceiptUpdate[] = receipt;
declare const m: WAMessage;
const w: BaileysWAMessage = m;
// our rebuilt message must be accepted by downloadMediaMessage's parameter
const back: WAMessage = { key: { remoteJid: "x", fromMe: false, id: "y" }, message: { imageMessage: { mediaKey: new Uint8Array(32) } } };
const s: number = proto.WebMessageInfo.Status.SERVER_ACK;
void like; void u; void mu; void r; void w; void back; void s;
