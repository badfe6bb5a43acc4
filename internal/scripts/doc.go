// Package scripts holds leash's Lua scripts, embedded from .lua files, and runs them
// by SHA (EVALSHA, falling back to EVAL on NOSCRIPT) through rueidis, whose
// auto-pipelining batches concurrent calls into few round trips.
//
// Each .lua file's header lists its KEYS, ARGV and replies; the wire layout follows
// Redisson's (see shared/PROTOCOL.md) so Go and Java services can share a lock.
//
// One write is not a script: RunLoneFresh takes a lock expected to be free with a
// RESTORE of the lock hash, which leaves what lock_acquire.lua would (see fresh.go).
package scripts
