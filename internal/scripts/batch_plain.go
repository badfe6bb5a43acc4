package scripts

import (
	"errors"
	"fmt"

	"github.com/redis/rueidis"
)

// A batch's uncontended lock operations go as plain commands, as they do alone
// on the lone lane: a fresh LockAcquire as RESTORE (RunLoneFresh), a quiet
// LockRelease as HDEL and PUBLISH (RunLoneQuietRelease), in the batch's one
// write, in their places among the merged script calls, so Redis runs
// everything in the calls' order. Measured in the harness's scenario B (256
// goroutines, each on a lock of its own, every call batched) on Redis 7.0: a
// lock and unlock cycle took about 10 µs of the server's time inside the
// merged script, of which its six commands proper took 2.6 µs and the Lua
// calls around them the rest.
//
// A RESTORE refused (the lock is held: BUSYKEY; or the command is not allowed)
// answers ErrFreshRefused, and the engine sends the acquire script at once
// (engine.resendRefusedFresh): the batch's other replies do not wait a round
// trip for it, as they would if RunBatch sent it itself.

// sendKind is how a batch sends a call.
type sendKind uint8

const (
	viaScript      sendKind = iota // in a merged script call (or its own EVALSHA)
	viaRestore                     // a fresh LockAcquire: RESTORE
	viaHdelPublish                 // a quiet LockRelease: HDEL, PUBLISH
)

// commands is how many commands a unit of kind k takes.
func (k sendKind) commands() int {
	if k == viaHdelPublish {
		return 2
	}
	return 1
}

// sendKindOf says how call goes in a batch.
func (r *Redis) sendKindOf(call Call) sendKind {
	switch {
	case call.Fresh && call.ID == LockAcquire && !r.noRestore.Load():
		if _, ok := freshLease(call.Keys, call.Args); ok {
			return viaRestore
		}
	case call.Quiet && call.ID == LockRelease && quietShape(LockRelease, call.Keys, call.Args) && !r.noPublish.Load():
		return viaHdelPublish
	}
	return viaScript
}

// appendCommands appends unit's commands, sent as kind says.
func (r *Redis) appendCommands(cmds rueidis.Commands, kind sendKind, unit []Call) rueidis.Commands {
	b := r.client.B()
	switch kind {
	case viaRestore:
		call := unit[0]
		lease, _ := freshLease(call.Keys, call.Args) // checked by sendKindOf
		return append(cmds, b.Restore().Key(call.Keys[0]).Ttl(lease).SerializedValue(lockDump(call.Args[1])).Build())
	case viaHdelPublish:
		hdel, publish := quietCommands(b, LockRelease, unit[0].Keys, unit[0].Args)
		return append(cmds, hdel, publish)
	}
	return append(cmds, r.command(unit))
}

// ErrFreshRefused is a batch's result for a fresh acquire whose RESTORE Redis
// refused: the lock exists (BUSYKEY), or the command is not allowed. Nothing
// ran; the caller sends the acquire script instead (the lone lane does that
// itself, RunLoneFresh, but a batch's other replies do not wait for it).
var ErrFreshRefused = errors.New("leash: RESTORE of a lock expected free was refused; nothing ran")

// restoreResult is a fresh acquire's result from its RESTORE: the script's
// "acquired" when it succeeded, the transport error when there was one, and
// ErrFreshRefused when Redis refused it. A refusal other than BUSYKEY or a
// transient one (an ACL without RESTORE, a renamed command, a server that reads
// the payload otherwise) sends this Redis's later fresh acquires to the script.
func (r *Redis) restoreResult(res rueidis.RedisResult) Result {
	err := res.Error()
	e, isReply := rueidis.IsRedisErr(err)
	switch {
	case err == nil:
		return Result{Reply: Reply{Nil: true}}
	case !isReply:
		return Result{Err: err}
	case !busyKey(e.Error()) && !transientRefusal(e.Error()):
		r.noRestore.Store(true)
	}
	return Result{Err: fmt.Errorf("%w (%v)", ErrFreshRefused, e)}
}

// quietLockResult is a plain lock's quiet release's result from its HDEL and
// PUBLISH (see RunLoneQuietRelease): nil when the owner's field was not there,
// 1 when the lock was released and somebody heard, 2 when nobody did. A PUBLISH
// refused after HDEL ran counts as heard by nobody and sends this Redis's later
// releases to the script.
func (r *Redis) quietLockResult(hdel, publish rueidis.RedisResult) Result {
	r.countRan(hdel, publish)
	deleted, err := hdel.AsInt64()
	if err != nil {
		return Result{Err: err}
	}
	heard, err := publish.AsInt64()
	if _, isReply := rueidis.IsRedisErr(err); isReply {
		// PUBLISH refused after HDEL ran: a user that may not publish (Redis 7's
		// default channel permissions for a new ACL user). The script publishes
		// only to listeners, so such a user's uncontended releases work with it:
		// this Redis gets the script from now on. The lock was released all the
		// same; nobody heard of it, as nobody would have with the script (which
		// fails alike when somebody listens).
		r.noPublish.Store(true)
		heard, err = 0, nil
	}
	switch {
	case err != nil:
		return Result{Err: err}
	case deleted == 0:
		return Result{Reply: Reply{Nil: true}}
	case heard > 0:
		return Result{Reply: Reply{Int: 1}}
	default:
		return Result{Reply: Reply{Int: 2}}
	}
}
