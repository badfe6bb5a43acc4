package engine

import (
	"strconv"
	"strings"
	"time"
)

// The wire names of Redisson's reentrant lock (shared/PROTOCOL.md, "Names").

// unlockMessage is published on a lock's channel when it is released: wake one.
const unlockMessage = "0"

// channelName returns the unlock channel of a lock, redisson_lock__channel:{name}.
// The braces are a Redis Cluster hash tag, so the lock key and its channel share a
// slot; a name that already contains a '{' is used bare, relying on its own tag.
func channelName(lock string) string {
	return "redisson_lock__channel:" + tagged(lock)
}

func tagged(lock string) string {
	if strings.Contains(lock, "{") {
		return lock
	}
	return "{" + lock + "}"
}

// ownerField returns the hash field of an owner, "<client-id>:<owner-id>", as
// Redisson writes "<uuid>:<thread-id>".
func ownerField(clientID string, owner uint64) string {
	return clientID + ":" + strconv.FormatUint(owner, 10)
}

// millis renders a duration as whole milliseconds for PEXPIRE, at least 1.
func millis(d time.Duration) string {
	ms := d.Milliseconds()
	if ms < 1 {
		ms = 1
	}
	return strconv.FormatInt(ms, 10)
}

// OwnerField returns the hash field an owner of this client writes in a lock,
// "<client-id>:<owner-id>".
func OwnerField(clientID string, owner uint64) string { return ownerField(clientID, owner) }

// ChannelName returns the unlock channel of a lock, redisson_lock__channel:{name}.
func ChannelName(lock string) string { return channelName(lock) }
