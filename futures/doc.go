// Package futures holds the complete-once result channels leash hands to callers.
//
// Two kinds, never mixed:
//
//   - A value future ([Future]) carries exactly one value and is never closed: a
//     second receive from a closed chan error would read nil, which for a lock means
//     "you hold it". Completion never blocks the completer (the channel has room for
//     the one value).
//   - A signal ([Signal]) is closed exactly once and never sent on, so any number of
//     receivers observe it (a lock's Lost channel).
//
// A grant that races a cancellation is settled with [Future.Revoke]: if the value is
// still sitting unreceived in the channel, the completer takes it back (a
// non-blocking receive, so the caller and the completer cannot both get it) and puts
// the replacement there instead. As in database/sql's handling of a connection
// nobody received, whoever takes a grant back must release what it granted.
package futures
