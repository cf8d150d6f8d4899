"""Privileged state of a LIBERO env: grip-site pose, object geometry, sites, joints.

Everything is read from the MuJoCo sim at call time (nothing cached but static model
lookups), so a plan that calls these between steps sees the current state.
"""

from __future__ import annotations

from typing import Any

import numpy as np

# unit-cube corners, for turning a geom's local AABB into its 8 world points
_CORNERS = np.array([[x, y, z] for x in (-1, 1) for y in (-1, 1) for z in (-1, 1)], np.float64)


class Scene:
    def __init__(self, env: Any):
        self.env = env
        self.sim = env.sim
        self.model = self.sim.model
        self.mj = self.sim.model._model  # the raw mujoco.MjModel
        self.rs = env._robosuite_env
        self._grip_site = self.model.site_name2id("gripper0_grip_site")
        parents = self.mj.body_parentid
        nbody = self.mj.nbody
        self._root_of = np.arange(nbody)  # top-level ancestor under the world body
        for b in range(1, nbody):
            r = b
            while parents[r] != 0:
                r = parents[r]
            self._root_of[b] = r
        collide = (self.mj.geom_contype != 0) | (self.mj.geom_conaffinity != 0)
        self._collision_geoms = np.nonzero(collide)[0]
        robot_roots = {
            self._root_of[b]
            for b in range(1, nbody)
            if self.model.body_id2name(b).startswith(("robot0", "gripper0", "mount0"))
        }
        self._robot_roots = robot_roots
        self._geoms_of: dict[int, np.ndarray] = {}

    # ---- robot ----
    def ee(self) -> tuple[np.ndarray, np.ndarray]:
        """Grip-site position (3,) and orientation matrix (3, 3), world frame."""
        pos = np.array(self.sim.data.site_xpos[self._grip_site])
        R = np.array(self.sim.data.site_xmat[self._grip_site]).reshape(3, 3)
        return pos, R

    def finger_gap(self) -> float:
        """Distance between the two finger joints' positions (0 closed .. 0.08 open)."""
        j1 = self.model.get_joint_qpos_addr("gripper0_finger_joint1")
        j2 = self.model.get_joint_qpos_addr("gripper0_finger_joint2")
        return float(self.sim.data.qpos[j1] - self.sim.data.qpos[j2])

    # ---- bodies ----
    def body_id(self, name: str) -> int:
        if name in self.rs.obj_body_id:
            return int(self.rs.obj_body_id[name])
        return int(self.model.body_name2id(name))

    def pos(self, name: str) -> np.ndarray:
        return np.array(self.sim.data.body_xpos[self.body_id(name)])

    def xmat(self, name: str) -> np.ndarray:
        return np.array(self.sim.data.body_xmat[self.body_id(name)]).reshape(3, 3)

    def _subtree_geoms(self, body: int) -> np.ndarray:
        if body not in self._geoms_of:
            geoms = []
            for g in self._collision_geoms:
                b = int(self.mj.geom_bodyid[g])
                while b != 0 and b != body:
                    b = int(self.mj.body_parentid[b])
                if b == body:
                    geoms.append(g)
            self._geoms_of[body] = np.array(geoms, dtype=int)
        return self._geoms_of[body]

    def geom_points(self, geoms: np.ndarray) -> np.ndarray:
        """World positions of the 8 corners of each geom's local bounding box, [8 G, 3]."""
        if len(geoms) == 0:
            return np.zeros((0, 3))
        aabb = self.mj.geom_aabb[geoms]  # [G, 6]: centre (3), half sizes (3), geom frame
        local = aabb[:, None, :3] + aabb[:, None, 3:] * _CORNERS[None]  # [G, 8, 3]
        xmat = np.asarray(self.sim.data.geom_xmat[geoms]).reshape(-1, 3, 3)
        xpos = np.asarray(self.sim.data.geom_xpos[geoms])
        world = np.einsum("gij,gkj->gki", xmat, local) + xpos[:, None]
        return world.reshape(-1, 3)

    def points(self, name: str) -> np.ndarray:
        """Corner points of the collision geometry of a body and its children, [N, 3]."""
        return self.geom_points(self._subtree_geoms(self.body_id(name)))

    def box(self, name: str) -> tuple[np.ndarray, np.ndarray]:
        pts = self.points(name)
        return pts.min(0), pts.max(0)

    def root(self, name: str) -> int:
        return int(self._root_of[self.body_id(name)])

    def support_height(
        self,
        lo_xy: np.ndarray,
        hi_xy: np.ndarray,
        exclude: set[int] = frozenset(),
        below: float = np.inf,
    ) -> float:
        """Highest top (below `below`) of the scene's collision geoms whose world AABB
        overlaps the rectangle [lo_xy, hi_xy]; robot geoms and the top-level bodies in
        `exclude` are ignored. The floor / table count."""
        geoms = self._collision_geoms
        roots = self._root_of[self.mj.geom_bodyid[geoms]]
        keep = ~np.isin(roots, list(self._robot_roots | set(exclude)))
        geoms = geoms[keep]
        pts = self.geom_points(geoms).reshape(-1, 8, 3)
        glo, ghi = pts.min(1), pts.max(1)
        # planes (the floor) have zero-size AABBs in x/y: treat them as everywhere
        plane = self.mj.geom_type[geoms] == 0
        overlap = np.all(glo[:, :2] <= hi_xy, axis=1) & np.all(ghi[:, :2] >= lo_xy, axis=1)
        overlap |= plane
        tops = np.where(plane, np.asarray(self.sim.data.geom_xpos[geoms])[:, 2], ghi[:, 2])
        tops = tops[overlap & (tops < below)]
        return float(tops.max()) if tops.size else 0.0

    # ---- sites and joints ----
    def site_pos(self, name: str) -> np.ndarray:
        return np.array(self.sim.data.get_site_xpos(name))

    def site_mat(self, name: str) -> np.ndarray:
        return np.array(self.sim.data.get_site_xmat(name)).reshape(3, 3)

    def site_size(self, name: str) -> np.ndarray:
        return np.asarray(self.rs.object_sites_dict[name].size, np.float64)

    def qpos(self, joint: str) -> float:
        return float(self.sim.data.qpos[self.model.get_joint_qpos_addr(joint)])

    def joint_anchor_axis(self, joint: str) -> tuple[np.ndarray, np.ndarray]:
        j = self.model.joint_name2id(joint)
        return np.array(self.sim.data.xanchor[j]), np.array(self.sim.data.xaxis[j])

    def is_object(self, name: str) -> bool:
        return name in self.rs.objects_dict or name in self.rs.fixtures_dict

    def is_site(self, name: str) -> bool:
        return name in self.rs.object_sites_dict
